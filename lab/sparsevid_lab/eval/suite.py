"""Every quality yardstick of dense and sparse configurations in one run (what ``python -m sparsevid_lab eval``
reports).

On top of the sampling harness (:func:`~sparsevid_lab.eval.harness.run_harness`: sparsity, PSNR / SSIM against
dense, time) it measures, for the dense model, the "every tile kept" path and every configuration:

* the **noise floor** (:mod:`~sparsevid.eval.noise_floor`): PSNR / SSIM of dense clips sampled through the
  block-sparse kernel with every tile kept, against the SDPA dense clips;
* the **velocity error** against the reference's velocity and the **held-out flow-matching loss**, per
  noise-level bin, on fixed held-out triples (:mod:`~sparsevid_lab.eval.heldout`), no sampling involved;
* **oracle recall** per layer and probed step (:mod:`~sparsevid.eval.oracle`): the mass of the exact top tiles
  over a sparsity grid, with each configuration's predicted recall and its ceiling beside it;
* **caption faithfulness** of the sampled clips (:mod:`~sparsevid_lab.eval.faithfulness`: what the pixels show
  against what the caption says, from the procedural ground truth).
"""
from __future__ import annotations

from typing import Sequence

from .harness import resolve_probe_steps, run_harness, video_token_grid
from sparsevid.eval.oracle import ORACLE_SPARSITIES, OracleStudy

DENSE_LABEL = "dense"


def run_suite(model, configs: dict, captions: Sequence[str], seeds: Sequence[int], steps: int,
              guidance: float | None = None, probe_steps: Sequence[int] | None = None, probe_clips: int = 1,
              heldout_per_bin: int = 8, noise_bins: int = 5, oracle_sparsities: Sequence[float] = ORACLE_SPARSITIES,
              reference=None, progress: bool = True) -> dict:
    """Run the harness and every yardstick (see the module docstring); returns the harness's results with
    "noise_floor" (an entry like a configuration's), "noise_floor_psnr" / "noise_floor_ssim", "oracle" (the
    :meth:`~sparsevid.eval.oracle.OracleStudy.summary`), and in the dense, noise-floor and configuration
    entries "velocity_error", "heldout_loss" ({"overall", "per_bin"}), "faithfulness" ({"overall",
    "per_attribute", "per_clip"}) and, for
    configurations, "predicted_recall" / "oracle_recall" (means over probed layers and steps).

    model: a dense BuiltinVideoDiT; configs: {label: SparseConfig}; reference: the model whose dense velocity
    the velocity error is measured against (default ``model``: then the dense entry's error is 0 by
    definition). One progress bar advances per sampled clip, per probed step and per held-out pass.
    """
    from tqdm.auto import tqdm

    from .faithfulness_summary import summarize_faithfulness
    from sparsevid.eval import heldout_loss, velocity_error

    from .heldout import heldout_set, predict_velocities
    from .noise_floor import EVERY_TILE_LABEL, every_tile_config, noise_floor

    if not configs:
        raise ValueError("configs must name at least one sparse configuration")
    jobs = [(c, s) for c in captions for s in seeds]
    probe_steps = resolve_probe_steps(steps, probe_steps)
    probe_jobs = jobs[:probe_clips]
    passes = 1 + (reference is not None) + 1 + len(configs)  # reference, dense unless it is the reference, the rest
    bar = tqdm(total=len(jobs) * (len(configs) + 2) + len(probe_jobs) * len(probe_steps) + passes,
               desc="eval", unit="clip", disable=not progress)
    try:
        bar.set_postfix_str("sampling")
        # The oracle study reads q, k, v of the harness's dense probe clips: they are sampled only once.
        study = OracleStudy(oracle_sparsities, dict(configs), video_token_grid(model))
        results = run_harness(model, configs, captions=captions, seeds=seeds, steps=steps, guidance=guidance,
                              probe_steps=probe_steps, probe_clips=probe_clips, bar=bar, on_attention=study.add,
                              on_probe=bar.update)
        guidance = results["settings"]["guidance"]
        clips = results["clips"]
        bar.set_postfix_str("noise floor")
        results["noise_floor"], clips[EVERY_TILE_LABEL] = noise_floor(model, jobs, clips[DENSE_LABEL], steps, guidance,
                                                                     on_clip=bar.update)
        results["noise_floor_psnr"] = results["noise_floor"]["psnr"]
        results["noise_floor_ssim"] = results["noise_floor"]["ssim"]

        bar.set_postfix_str("held-out velocity")
        heldout = heldout_set(model, model.data, heldout_per_bin, noise_bins)
        results["settings"]["heldout"] = heldout.describe()
        reference_velocity = predict_velocities(reference or model, heldout)
        bar.update()
        entries = {DENSE_LABEL: (results["dense"], None), EVERY_TILE_LABEL: (results["noise_floor"], every_tile_config()),
                   **{name: (results["configs"][name], config) for name, config in configs.items()}}
        for label, (entry, config) in entries.items():
            if config is None and reference is None:
                velocity = reference_velocity
            else:
                velocity = predict_velocities(model, heldout, config)
                bar.update()
            entry["velocity_error"] = velocity_error(velocity, reference_velocity, heldout)
            entry["heldout_loss"] = heldout_loss(velocity, heldout)

        oracle = study.summary() if probe_jobs else None
        results["oracle"] = oracle
        for name in configs:
            predicted = oracle["predicted"][name] if oracle else {}
            results["configs"][name]["predicted_recall"] = predicted.get("recall_mean")
            results["configs"][name]["oracle_recall"] = predicted.get("oracle_recall_mean")

        texts = [c for c, _ in jobs]
        for label, (entry, _) in entries.items():
            entry["faithfulness"] = summarize_faithfulness(clips[label], texts)
    finally:
        bar.close()
    return results


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _entries(results: dict):
    """(label, entry, is_sparse) of the dense entry, the noise floor and every configuration, in order."""
    from .noise_floor import EVERY_TILE_LABEL

    yield DENSE_LABEL, results["dense"], False
    yield f"{EVERY_TILE_LABEL} (noise floor)", results["noise_floor"], True
    for name, entry in results["configs"].items():
        yield f"`{name}`", entry, True


def suite_table(results: dict, smoke_test: bool = False) -> str:
    """The results of :func:`run_suite` as Markdown tables."""
    settings = results["settings"]
    heldout = settings["heldout"]
    lines = []
    if smoke_test:
        lines += ["**Smoke test: an untrained tiny model. These numbers only show that the pipeline runs; they "
                  "say nothing about the quality of sparse attention.**", ""]
    lines += [f"{len(settings['captions'])} captions x {len(settings['seeds'])} seeds, {settings['steps']} steps, "
              f"guidance {settings['guidance']}, device {settings['device']}; dense sampling "
              f"{results['dense']['seconds']:.1f} s. Noise floor (dense vs dense with every tile kept through the "
              f"sparse kernel): PSNR {results['noise_floor_psnr']:.2f} dB, SSIM {results['noise_floor_ssim']:.4f}. "
              f"Velocity error and held-out loss over {heldout['triples']} held-out (clip, noise, t) triples.", "",
              "| setting | sparsity | PSNR (dB) | SSIM | faithfulness | velocity error | held-out loss | "
              "recall (predicted / oracle) | rel. L1 | time (s) | vs dense |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for label, r, sparse in _entries(results):
        faith = r["faithfulness"]["overall"]
        recall = (f"{r['predicted_recall']:.3f} / {r['oracle_recall']:.3f}"
                  if r.get("predicted_recall") is not None else "-")
        lines.append(f"| {label} | {r['sparsity'] if sparse else 0.0:.3f} | {_fmt(r.get('psnr'), '.2f')} | "
                     f"{_fmt(r.get('ssim'), '.4f')} | {_fmt(faith, '.3f')} | {r['velocity_error']['overall']:.4f} | "
                     f"{r['heldout_loss']['overall']:.4f} | {recall} | {_fmt(r.get('rel_l1'), '.4f')} | "
                     f"{r['seconds']:.1f} | {_fmt(r.get('speedup'), '.2f')}{'x' if r.get('speedup') else ''} |")
    edges = heldout["bin_edges"]
    bins = [f"t {a:.1f}-{b:.1f}" for a, b in zip(edges, edges[1:])]
    for key, title in (("velocity_error", "Velocity error (relative L2 against the reference velocity) per noise level"),
                       ("heldout_loss", "Held-out flow-matching loss per noise level")):
        lines += ["", f"{title}:", "", "| setting | " + " | ".join(bins) + " | all |", "|---|" + "---|" * (len(bins) + 1)]
        for label, r, _ in _entries(results):
            lines.append(f"| {label} | " + " | ".join(f"{x:.4f}" for x in r[key]["per_bin"])
                         + f" | {r[key]['overall']:.4f} |")
    lines += _faithfulness_lines(results) + _oracle_lines(results)
    return "\n".join(lines) + "\n"


def _faithfulness_lines(results: dict) -> list[str]:
    names = sorted({n for _, r, _ in _entries(results) for n in r["faithfulness"]["per_attribute"]})
    lines = ["", "Caption faithfulness per attribute (mean over clips):", "",
             "| setting | overall | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    for label, r, _ in _entries(results):
        f = r["faithfulness"]
        lines.append(f"| {label} | {f['overall']:.3f} | "
                     + " | ".join(_fmt(f["per_attribute"].get(n), ".3f") for n in names) + " |")
    return lines


def _oracle_lines(results: dict) -> list[str]:
    oracle = results.get("oracle")
    if oracle is None:
        return []
    o = oracle["oracle"]
    lines = ["", f"Oracle (exact top tiles of each row, 3D-tiled order; layers x probe steps {oracle['steps']}):", "",
             "| target sparsity | achieved | oracle recall | oracle output rel. L1 |", "|---|---|---|---|"]
    for x, achieved, recall, error in zip(oracle["sparsities"], o["achieved_sparsity"], o["recall_mean"],
                                          o["output_rel_l1_mean"]):
        lines.append(f"| {x:.2f} | {achieved:.3f} | {recall:.4f} | {error:.4f} |")
    layers = oracle["layers"]
    lines += ["", "Recall per layer (oracle at each target sparsity; predicted / its oracle at the same per-row "
                  "tile counts):", "", "| | " + " | ".join(f"layer {la}" for la in layers) + " |",
              "|---|" + "---|" * len(layers)]
    for i, x in enumerate(oracle["sparsities"]):
        lines.append(f"| oracle {x:.0%} | " + " | ".join(f"{row[i]:.3f}" for row in o["recall_per_layer"]) + " |")
    for name, p in oracle["predicted"].items():
        lines.append(f"| `{name}` | " + " | ".join(
            f"{a:.3f} / {b:.3f}" for a, b in zip(p["recall_per_layer"], p["oracle_recall_per_layer"])) + " |")
    return lines
