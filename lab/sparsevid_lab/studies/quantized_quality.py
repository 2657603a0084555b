"""End-to-end quality of the quantized sparse forwards on the built-in model (issue 37, item 2).

For each sparsity in ``--sparsities`` the top-k rule keeping 1 - s of the key blocks runs at the native precision
(bf16 on a GPU) and at each quantized precision in ``--precisions`` ("int8": int8 Q K^T, e4m3 P V; "fp8": both
products on e4m3), everything else equal: the same rule predicts each layer's mask from that layer's own q and k.
Measured:

* PSNR of each quantized setting's sampled clips against the native sparse setting's clips of the same captions and
  seeds (the issue's bar: at least 30 dB), and of every setting against the dense clips;
* velocity error against the dense model on held-out (clip, noise, t) triples (``heldout_set``), and its ratio to the
  native sparse setting's (the bar: at most 1.10);
* the floor of the clip bar: the native setting sampled again on ``--floor-backend`` (default "gather": the same
  sparse attention computed in float32 by other code), whose clips differ from the native ones by rounding alone.
  A quantized setting cannot be expected closer to the native clips than this.
* with ``--replay-masks``, the same clip comparison with every layer's mask held as the native run predicted it
  (recorded from a native sampling, replayed in each quantized and floor setting's): what rounding does to the clips
  apart from flipping tiles near a row's threshold (``sparsevid_lab.eval.mask_replay``).

On a GPU the Triton kernels run (``backend="auto"``); on the CPU the PyTorch emulation of the same quantization
(``backend="reference"``, the native setting too). Writes results.json and results.md under --out.

    python -m sparsevid_lab.studies.quantized_quality --out OUT          # the long clip, on a GPU with FP8 (sm_89+)
    # CPU check of the code path (an untrained tiny model; numbers meaningless):
    python -m sparsevid_lab.studies.quantized_quality --out /tmp/q --tiny --device cpu --steps 2 --captions 1 \\
        --heldout-per-bin 1 --noise-bins 1 --block-q 64 --block-k 64
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import sparsevid as sv
from benchmarks.run_info import recorded_args, run_metadata
from sparsevid.eval import HELDOUT_SEED
from sparsevid.eval.video_metrics import psnr

from ..cli.args import add_study_model_options, parse_study_args
from ..eval.harness import DEFAULT_CAPTIONS, run_harness, sample_with_stats
from ..eval.heldout import heldout_set, sparse_velocity_errors
from ..eval.mask_replay import recording_masks, replaying_masks

PRECISIONS = ("int8", "fp8")
PSNR_BAR, VELOCITY_BAR = 30.0, 1.10  # issue 37: quantized vs native sparse clip; velocity error ratio


def label(precision: str, sparsity: float) -> str:
    return f"{precision} top-k {sparsity:.0%}"


def floor_label(sparsity: float, backend: str) -> str:
    return f"native ({backend}) top-k {sparsity:.0%}"


def settings(sparsities, precisions, blocks: dict, backend: str, floor_backend: str | None = None) -> dict:
    """{label: SparseConfig}: top-k keeping 1 - s of the key blocks for every s, at "native" and each precision,
    and with ``floor_backend`` the native setting on that backend too."""
    def topk(s, precision, on):
        return sv.SparseConfig(rule="topk", topk=round(1.0 - s, 6), precision=precision, backend=on, **blocks)

    configs = {label(precision, s): topk(s, precision, backend)
               for s in sparsities for precision in ("native", *precisions)}
    if floor_backend is not None:
        configs.update({floor_label(s, floor_backend): topk(s, "native", floor_backend) for s in sparsities})
    return configs


def compared_settings(sparsity: float, precisions, floor_backend: str | None = None) -> dict:
    """{row name: setting label} of the settings compared with the native one at ``sparsity``: each quantized
    precision, then the floor setting where there is one."""
    names = {precision: label(precision, sparsity) for precision in precisions}
    if floor_backend is not None:
        names[f"native ({floor_backend})"] = floor_label(sparsity, floor_backend)
    return names


def clip_agreement(clips, native) -> dict:
    """PSNR of ``clips`` against the ``native`` clips (mean and min over clips) and the verdict against the clip
    bar (every clip at least PSNR_BAR)."""
    against_native = psnr(clips, native)
    return {"psnr_vs_native": float(against_native.mean()), "psnr_vs_native_min": float(against_native.min()),
            "psnr_bar_met": bool(against_native.min() >= PSNR_BAR)}


def compare(results: dict, clips: dict, sparsities, precisions, floor_backend: str | None = None) -> list[dict]:
    """One row per (sparsity, quantized precision, and the floor setting where there is one): its clips' PSNR
    against the native sparse clips, and the velocity-error ratio to the native setting's, with the verdicts
    against the issue's bars."""
    rows = []
    for s in sparsities:
        native = label("native", s)
        for precision, name in compared_settings(s, precisions, floor_backend).items():
            ratio = results[name]["velocity_error"] / results[native]["velocity_error"]
            rows.append({"sparsity": s, "precision": precision, **clip_agreement(clips[name], clips[native]),
                         "velocity_ratio": ratio, "velocity_bar_met": bool(ratio <= VELOCITY_BAR)})
    return rows


def replayed_masks_comparison(model, configs: dict, jobs, steps, guidance, sparsities, precisions,
                              floor_backend: str | None = None) -> list[dict]:
    """Per sparsity: the native setting sampled while its masks are recorded, then each quantized precision (and
    the floor setting where there is one) sampled with those masks replayed. One row per setting: its clips' PSNR
    against the recording run's (mean, min) and the verdict against the clip bar."""
    rows = []
    for s in sparsities:
        with recording_masks() as masks:
            native, _, _ = sample_with_stats(model, configs[label("native", s)], jobs, steps, guidance,
                                             progress=f"native {s:.0%}, recording masks")
        for precision, name in compared_settings(s, precisions, floor_backend).items():
            with replaying_masks(masks):
                clips, _, _ = sample_with_stats(model, configs[name], jobs, steps, guidance,
                                                progress=f"{name}, native masks")
            rows.append({"sparsity": s, "precision": precision, "masks": "native, replayed",
                         **clip_agreement(clips, native)})
    return rows


def table(report: dict) -> str:
    lines = [f"# Quantized sparse forwards end to end ({report['meta']['gpu']}, commit {report['meta']['commit']})", "",
             f"Clip {report['clip']}, {report['steps']} steps, {report['clips']} clips; velocity error on "
             f"{report['heldout']} held-out triples.", "",
             "| setting | sparsity | PSNR vs dense dB | velocity error vs dense |", "|---|---|---|---|"]
    for name, r in report["settings"].items():
        lines.append(f"| {name} | {r['sparsity']:.3f} | {r['psnr']:.2f} | {r['velocity_error']:.4f} |")
    lines += ["", f"Against the native sparse setting (bars: PSNR >= {PSNR_BAR:g} dB on every clip, velocity error "
                  f"at most {VELOCITY_BAR:.2f}x; a \"native (backend)\" row is the native setting on another "
                  "backend, the floor rounding alone sets):", "",
              "| sparsity | precision | PSNR vs native dB (mean / min) | velocity error ratio | bars met |",
              "|---|---|---|---|---|"]
    for r in report["comparison"]:
        met = "yes" if r["psnr_bar_met"] and r["velocity_bar_met"] else "no"
        lines.append(f"| {r['sparsity']:.0%} | {r['precision']} | {r['psnr_vs_native']:.2f} / "
                     f"{r['psnr_vs_native_min']:.2f} | {r['velocity_ratio']:.3f} | {met} |")
    if report.get("replayed_masks"):
        lines += ["", "With the native run's masks replayed in every layer (no tile flips; clip bar only):", "",
                  "| sparsity | precision | PSNR vs native dB (mean / min) | clip bar met |", "|---|---|---|---|"]
        for r in report["replayed_masks"]:
            lines.append(f"| {r['sparsity']:.0%} | {r['precision']} | {r['psnr_vs_native']:.2f} / "
                         f"{r['psnr_vs_native_min']:.2f} | {'yes' if r['psnr_bar_met'] else 'no'} |")
    return "\n".join(lines) + "\n"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--sparsities", type=float, nargs="+", default=[0.95, 0.63])
    parser.add_argument("--precisions", nargs="+", choices=PRECISIONS, default=list(PRECISIONS))
    parser.add_argument("--captions", type=int, default=4, help="evaluation captions")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="evaluation seeds")
    parser.add_argument("--steps", type=int, default=None, help="sampler steps (default: the model's)")
    parser.add_argument("--guidance", type=float, default=None, help="default: the model's")
    parser.add_argument("--heldout-per-bin", type=int, default=8, help="velocity error: triples per noise bin")
    parser.add_argument("--noise-bins", type=int, default=5)
    parser.add_argument("--heldout-seed", type=int, default=HELDOUT_SEED)
    parser.add_argument("--floor-backend", default="gather", choices=("gather", "reference", "flex", "none"),
                        help="the native setting again on this backend: the rounding floor of the clip bar "
                             "(none: skip)")
    parser.add_argument("--replay-masks", action="store_true",
                        help="also sample each quantized and floor setting with the native run's masks replayed")
    add_study_model_options(parser)
    return parse_study_args(parser, argv)


def main(argv=None) -> dict:
    from ..cli.demo import load_study_model

    args = parse_args(argv)
    model, device, steps, blocks = load_study_model(args)
    backend = "auto" if device.type == "cuda" else "reference"
    floor = None if args.floor_backend in ("none", backend) else args.floor_backend
    configs = settings(args.sparsities, args.precisions, blocks, backend, floor)
    captions = [c for c in DEFAULT_CAPTIONS if model.data.fits(c)][:args.captions]
    sampled = run_harness(model, configs, captions=captions, seeds=args.seeds, steps=steps, guidance=args.guidance,
                          probe_clips=0)
    heldout = heldout_set(model, per_bin=args.heldout_per_bin, num_bins=args.noise_bins, seed=args.heldout_seed)
    velocity = sparse_velocity_errors(model, heldout, configs)
    results = {name: {"sparsity": sampled["configs"][name]["sparsity"], "psnr": sampled["configs"][name]["psnr"],
                      "velocity_error": velocity[name]["velocity_error"],
                      "velocity_sparsity": velocity[name]["sparsity"]} for name in configs}
    report = {"meta": run_metadata(device), "clip": list(model.clip_shape[1:]), "steps": steps,
              "clips": len(captions) * len(args.seeds), "heldout": len(heldout), "settings": results,
              "comparison": compare(results, sampled["clips"], args.sparsities, args.precisions, floor),
              "configs": {name: config.to_dict() for name, config in configs.items()},
              "replayed_masks": replayed_masks_comparison(
                  model, configs, [(c, s) for c in captions for s in args.seeds], steps, args.guidance,
                  args.sparsities, args.precisions, floor) if args.replay_masks else [],
              "args": recorded_args(args)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(report, indent=1) + "\n")
    (args.out / "results.md").write_text(table(report))
    print(table(report))
    return report


if __name__ == "__main__":
    main()
