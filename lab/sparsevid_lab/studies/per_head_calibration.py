"""Per-head calibration against the best global rule on the built-in model, at equal mean sparsity.

1. Calibrate once (``calibrate_builtin``: the library's ``calibrate_heads`` over the dense sampling of
   ``--calib-captions`` captions, every step, every layer and head), timed.
   ``--calibration FILE`` reuses a calibration file of the same model and clip instead (e.g. this study's own).
   ``--noise-splits S ...`` measures by noise range (``NoiseRangeCalibration``, saved as calibration_ranges.json):
   the setting "per-head-ranges" allocates over every range at once; the other per-head settings use the same
   measurements pooled (what one measurement without ranges finds).
2. For each target in ``--sparsities`` (default 63%, 90%, 95%): the per-head configurations chosen for it
   (``Calibration.config(target_sparsity=..., error=...)`` for each kind of head error in ``--errors``: "per-head"
   minimises the heads' relative output errors, "per-head-abs" their absolute ones, "per-head-out" their errors
   through the output projection), and the three global rules (top-k, top-p, hybrid) calibrated by
   ``sparsevid.eval.calibrate_rules`` to the mean sparsity the relative per-head choice reaches on the calibration
   clips, so that every setting of one target removes the same share of attention. Top-k keeps a whole number of
   key blocks per row (rounded up): compare at targets it reaches exactly (e.g. 0.9375 and 0.953125 for the 64 key
   blocks of the CPU clip).
3. Every setting samples the evaluation captions x seeds (``run_harness``): achieved mean sparsity, PSNR and SSIM
   against the dense clips, predicted and oracle recall (``OracleStudy``: the exact mass the masks keep and the
   mass of the heaviest tiles at the same per-row counts) on the first clip's dense attention; the velocity error
   against the dense model on held-out (clip, noise, t) triples of each seed in ``--heldout-seeds`` (one set per
   seed), with the sparsity achieved on them. The best global rule of a target is the one with the highest PSNR
   (without sampling: the lowest velocity error).
4. Runtime overhead of per-head budgets: the mask prediction and attention of one layer call with a scalar
   plan and with a per-head plan holding the same values in every head (identical masks, checked), eager and
   under ``torch.compile``; the overhead is reported as a share of the scalar call's whole attention time.

``--metrics`` chooses the measurements (all by default): "sampling" (the sampled clips of 3: sparsity, PSNR, SSIM,
recalls), "velocity" (the held-out velocity errors of 3), "overhead" (4). ``--metrics velocity`` alone compares the
settings without sampling (at the CPU clip about 10 minutes per held-out set of 20 triples on 2 CPU cores).

Writes results.json, results.md, calibration.json and one heat map per target (calibration_<target>.png) under --out.

    python -m sparsevid_lab.studies.per_head_calibration --out lab/results/per_head_calibration_h200
    # CPU check of the same code path (an untrained tiny model; numbers meaningless):
    python -m sparsevid_lab.studies.per_head_calibration --out /tmp/phc --tiny --device cpu --steps 2 --captions 1 \\
        --calib-captions 1 --seeds 0 --sparsities 0.5 --heldout-per-bin 1 --noise-bins 1 --block-q 64 --block-k 64
    # velocity error only, on two held-out sets, reusing a calibration of the CPU clip:
    python -m sparsevid_lab.studies.per_head_calibration --out OUT --device cpu --clip 16,64,64 \\
        --calibration FILE --sparsities 0.9375 0.953125 --rules topk --metrics velocity --heldout-seeds 2718281 20240601
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import sparsevid as sv
from benchmarks.run_info import recorded_args, run_metadata
from benchmarks.timing import median_ms
from sparsevid.eval import HELDOUT_SEED, OracleStudy, calibrate_rules
from sparsevid.eval.calibrate import plot_calibration
from sparsevid.plan import LayerRuntime
from sparsevid.plan.calibration import Calibration
from sparsevid.plan.noise_ranges import NoiseRangeCalibration, load_calibration

from ..cli.args import add_study_model_options, parse_study_args
from ..cli.calibrate import calibrate_builtin
from ..eval.harness import DEFAULT_CAPTIONS, run_harness, video_token_grid
from ..eval.heldout import heldout_set, sparse_velocity_errors
from ..eval.recording import record_video_attention

RULES = ("topk", "topp", "hybrid")
METRICS = ("sampling", "velocity", "overhead")
PER_HEAD = {"relative": "per-head", "absolute": "per-head-abs", "output": "per-head-out"}  # label of each error
RANGES = "per-head-ranges"  # the label of the calibration by noise range
OVERHEAD_TOPK = 0.1  # the overhead's setting: top-k 10% in every head (per-head: the same value in each)
OFF = 1e-6


def _label(kind: str, target: float) -> str:
    return f"{kind} {target:.0%}"


def settings_for(calibration, calls, target: float, blocks: dict, errors=tuple(PER_HEAD),
                 rules=RULES, ranged: NoiseRangeCalibration | None = None) -> tuple[dict, float]:
    """({label: SparseConfig}, the per-head choice's mean sparsity on the calibration clips) at ``target``: the
    per-head configurations allocated on each kind of head error in ``errors`` (and, given the same measurements
    by noise range, ``ranged``, its configuration on the default error: "per-head-ranges") and the global ``rules``
    calibrated to the relative one's mean sparsity."""
    reached = calibration.summary(calibration.allocate(target_sparsity=target))["mean_sparsity"]
    calibrated = calibrate_rules(calls, [min(reached, 0.999)], **blocks)
    configs = {_label(PER_HEAD[error], target): calibration.config(target_sparsity=target, error=error)
               for error in errors}
    if ranged is not None:
        configs[_label(RANGES, target)] = ranged.config(target_sparsity=target)
    for rule in rules:
        (config,) = [c for label, c in calibrated.items() if label.startswith(rule + " ")]
        configs[_label(rule, target)] = config
    return configs, reached


def reused_calibration(path: Path, model, blocks: dict) -> tuple[Calibration | NoiseRangeCalibration,
                                                                  list[tuple[str, int]]]:
    """A calibration file of the built-in model at its current clip and tiles (measured by noise range or not), and
    its (caption, seed) jobs; ValueError naming what differs."""
    calibration = load_calibration(path)
    part = calibration.parts[0]
    measured = {"clip": part.inputs.get("clip"), **{k: part.settings.get(k) for k in blocks}}
    wanted = {"clip": list(model.clip_shape[1:]), **blocks}
    if measured != wanted:
        raise ValueError(f"--calibration {path} was measured at {measured}, this run uses {wanted}")
    return calibration, [tuple(job) for job in part.inputs["jobs"]]


def _timed(fn, device: torch.device) -> float:
    fn()  # compiles, when compiled
    return median_ms(fn, device, reps=5)


def head_overhead(calls, heads: int, device: torch.device, block_q: int, block_k: int, compile_too: bool) -> dict:
    """Time of mask prediction and of prediction + attention (ms, medians) for recorded (q, k) ``calls`` (v drawn
    at random), with a scalar plan and a per-head plan of equal values; "overhead_share": (per-head - scalar) /
    scalar attention, averaged over the calls; eager and (``compile_too``) compiled, on the first call."""
    common = dict(rule="hybrid", block_q=block_q, block_k=block_k)
    scalar = sv.SparseConfig(topk=OVERHEAD_TOPK, topp=OFF, **common)
    per_head = sv.SparseConfig(topk=[OVERHEAD_TOPK] * heads, topp=[OFF] * heads, **common)
    modes = {"eager": lambda fn: fn}
    if compile_too:
        modes["compiled"] = lambda fn: torch.compile(fn, fullgraph=True)
    result = {}
    for mode, wrap in modes.items():
        rows = []
        # Compiled: one call (each timed function compiles once per call, within dynamo's recompile limit).
        for q, k in calls if mode == "eager" else calls[:1]:
            v = torch.randn_like(k)
            row = {}
            for name, config in (("scalar", scalar), ("per_head", per_head)):
                runtime = LayerRuntime(0, config)
                predict = wrap(lambda runtime=runtime, q=q, k=k: runtime.mask(q, k, None).keep)
                attend = wrap(lambda runtime=runtime, q=q, k=k, v=v: sv.block_sparse_attention(
                    q, k, v, runtime.mask(q, k, None)))
                row[f"{name}_predict_ms"], row[f"{name}_attention_ms"] = _timed(predict, device), _timed(attend, device)
                row[f"{name}_keep"] = predict()
            if not torch.equal(row.pop("scalar_keep"), row.pop("per_head_keep")):
                raise RuntimeError("the per-head plan of equal values predicted other masks than the scalar plan")
            row["overhead_share"] = (row["per_head_attention_ms"] - row["scalar_attention_ms"]) / row[
                "scalar_attention_ms"]
            rows.append(row)
        torch._dynamo.reset()
        result[mode] = {key: sum(r[key] for r in rows) / len(rows) for key in rows[0]}
    return result


def _cell(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(results: dict) -> str:
    seeds = results["heldout_seeds"]
    lines = [f"# Per-head calibration vs global rules ({results['gpu']}, commit {results['commit']})", "",
             (f"Clip {results['clip']} ({results['tokens']} tokens), {results['steps']} steps; "
              + ("calibration reused from a file" if results['calibration']['seconds'] is None
               else f"calibration {results['calibration']['seconds']:.1f} s")
              + f" on {len(results['calibration']['jobs'])} clips; metrics: {', '.join(results['metrics'])}."), "",
             "Velocity error: relative L2 against the dense model on each held-out set (seed), with the sparsity "
             "achieved on it.", "",
             ("| target | setting | sparsity | PSNR dB | SSIM | recall | oracle recall | "
              + " | ".join(f"velocity error (held-out {seed}) | sparsity ({seed})" for seed in seeds) + " |"),
             "|---|---|---|---|---|---|---|" + "---|---|" * len(seeds)]
    for target in results["targets"]:
        for label in target["labels"]:
            c = results["configs"][label]
            best = " (best global)" if label == target["best_global"] else ""
            sets = [c["heldout"][str(seed)] for seed in seeds]
            lines.append(f"| {target['target']:.2%} | {label}{best} | {_cell(c.get('sparsity'), '.3f')} | "
                         f"{_cell(c.get('psnr'), '.2f')} | {_cell(c.get('ssim'), '.3f')} | "
                         f"{_cell(c.get('predicted_recall'), '.3f')} | {_cell(c.get('oracle_recall'), '.3f')} | "
                         + "".join(f"{h['velocity_error']:.4f} | {_cell(h['sparsity'], '.4f')} | " for h in sets)
                         .rstrip(" "))
    if results["overhead"] is not None:
        lines += ["", "Runtime overhead of per-head budgets (one layer call, same values in every head):", "",
                  ("| mode | scalar predict ms | per-head predict ms | scalar attention ms | per-head attention ms | "
                   "overhead |"), "|---|---|---|---|---|---|"]
        for mode, o in results["overhead"].items():
            lines.append(f"| {mode} | {o['scalar_predict_ms']:.3f} | {o['per_head_predict_ms']:.3f} | "
                         f"{o['scalar_attention_ms']:.3f} | {o['per_head_attention_ms']:.3f} | "
                         f"{o['overhead_share']:.2%} |")
    return "\n".join(lines) + "\n"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--sparsities", type=float, nargs="+", default=[0.63, 0.9, 0.95])
    parser.add_argument("--calib-captions", type=int, default=2, help="captions sampled for the calibration (seed 0)")
    parser.add_argument("--calibration", type=Path, default=None,
                        help="a calibration file of this model and clip to reuse (default: calibrate)")
    parser.add_argument("--errors", nargs="+", choices=tuple(PER_HEAD), default=list(PER_HEAD),
                        help="head errors to allocate per-head settings on")
    parser.add_argument("--rules", nargs="+", choices=RULES, default=list(RULES),
                        help="global rules to compare with")
    parser.add_argument("--noise-splits", type=float, nargs="+", default=(),
                        help="also calibrate by noise range, split at these noise levels (ascending in (0, 1)): "
                             "the setting per-head-ranges, allocated over every range at once (the other per-head "
                             "settings use the same measurements pooled)")
    parser.add_argument("--metrics", nargs="+", choices=METRICS, default=list(METRICS),
                        help="what to measure: sampling (PSNR, SSIM, recalls), velocity (held-out), overhead")
    parser.add_argument("--captions", type=int, default=4, help="evaluation captions (after the calibration ones)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2], help="evaluation seeds")
    parser.add_argument("--steps", type=int, default=None, help="sampler steps (default: the model's)")
    parser.add_argument("--guidance", type=float, default=None, help="default: the model's")
    parser.add_argument("--heldout-per-bin", type=int, default=4, help="velocity error: triples per noise bin")
    parser.add_argument("--heldout-seeds", type=int, nargs="+", default=[HELDOUT_SEED],
                        help="velocity error: one held-out set of triples per seed")
    parser.add_argument("--noise-bins", type=int, default=5)
    parser.add_argument("--overhead-calls", type=int, default=3, help="recorded calls timed for the overhead")
    add_study_model_options(parser)
    return parse_study_args(parser, argv)


def main(argv=None) -> dict:
    from ..cli.demo import load_study_model

    args = parse_args(argv)
    model, device, steps, blocks = load_study_model(args)
    captions = [c for c in DEFAULT_CAPTIONS if model.data.fits(c)]
    calib_jobs = [(c, 0) for c in captions[:args.calib_captions]]
    eval_captions = captions[args.calib_captions:args.calib_captions + args.captions] or captions[:args.captions]
    grid = video_token_grid(model)
    print(f"device {device}, clip {model.clip_shape[1:]} ({grid[0] * grid[1] * grid[2]} tokens), {steps} steps",
          flush=True)

    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    if args.calibration is None:
        measured = calibrate_builtin(model, calib_jobs, steps, args.guidance, noise_splits=args.noise_splits,
                                     **blocks)
    else:
        measured, calib_jobs = reused_calibration(args.calibration, model, blocks)
    ranged = measured if isinstance(measured, NoiseRangeCalibration) else None
    calibration = measured.pooled() if ranged is not None else measured
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    calibration_seconds = time.perf_counter() - start if args.calibration is None else None
    calls = record_video_attention(model, calib_jobs[0][0], calib_jobs[0][1], steps, args.guidance)

    overhead = None
    if "overhead" in args.metrics:
        overhead = head_overhead(calls[:args.overhead_calls], calibration.model["heads"][0], device, args.block_q,
                                 args.block_k, compile_too=device.type == "cuda")

    configs, targets = {}, []
    args.out.mkdir(parents=True, exist_ok=True)
    for target in args.sparsities:
        chosen, reached = settings_for(calibration, calls, target, blocks, args.errors, args.rules, ranged)
        configs.update(chosen)
        targets.append({"target": target, "calibrated_sparsity": reached, "labels": list(chosen)})
        calibration.choose(target_sparsity=target)
        plot_calibration(calibration, args.out / f"calibration_{round(target * 100)}.png")
        if ranged is not None:
            ranged.choose(target_sparsity=target)
            plot_calibration(ranged, args.out / f"calibration_ranges_{round(target * 100)}.png")
    results = {**run_metadata(device), "clip": list(model.clip_shape[1:]), "tokens": grid[0] * grid[1] * grid[2],
               "steps": steps, "metrics": args.metrics, "heldout_seeds": [], "targets": targets,
               "overhead": overhead, "configs": {label: {"config": config.to_dict(), "heldout": {}}
                                                 for label, config in configs.items()},
               "calibration": {"seconds": calibration_seconds, "jobs": [list(j) for j in calib_jobs],
                               "calls_per_layer": calibration.inputs["calls_per_layer"],
                               "noise_splits": None if ranged is None else list(ranged.splits),
                               "range_weights": None if ranged is None else ranged.weights()},
               "args": recorded_args(args)}
    if "sampling" in args.metrics:
        results.update(sampled_metrics(model, configs, results["configs"], args, eval_captions, steps, grid, blocks))
    if "velocity" in args.metrics:
        results["heldout_seeds"] = args.heldout_seeds
        for seed in args.heldout_seeds:
            heldout = heldout_set(model, per_bin=args.heldout_per_bin, num_bins=args.noise_bins, seed=seed)
            for label, measured in sparse_velocity_errors(model, heldout, configs).items():
                results["configs"][label]["heldout"][str(seed)] = measured
        for row in results["configs"].values():  # the mean over the held-out sets
            row["velocity_error"] = sum(h["velocity_error"] for h in row["heldout"].values()) / len(row["heldout"])
    rows = results["configs"]
    for target in targets:  # the best global rule: highest PSNR, else lowest velocity error, else none
        rules = [label for label in target["labels"] if not label.startswith("per-head")]
        if "sampling" in args.metrics:
            target["best_global"] = max(rules, key=lambda label: rows[label]["psnr"])
        elif "velocity" in args.metrics:
            target["best_global"] = min(rules, key=lambda label: rows[label]["velocity_error"])
        else:
            target["best_global"] = None
    calibration.choose(target_sparsity=args.sparsities[0])
    calibration.save(args.out / "calibration.json")
    if ranged is not None:
        ranged.choose(target_sparsity=args.sparsities[0])
        ranged.save(args.out / "calibration_ranges.json")
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    (args.out / "results.md").write_text(table(results))
    print(table(results))
    print(f"wrote {args.out / 'results.json'} and {args.out / 'results.md'}")
    return results


def sampled_metrics(model, configs: dict, rows: dict, args, captions, steps: int, grid, blocks: dict) -> dict:
    """Sample every setting of ``configs`` ({label: SparseConfig}) for ``captions`` x ``args.seeds`` and add to each
    ``rows[label]`` its achieved sparsity, PSNR, SSIM, times and predicted / oracle recall; returns the harness's
    settings and the oracle's summary for the results."""
    study = OracleStudy(sorted(args.sparsities), configs, grid, **blocks)
    harness = run_harness(model, configs, captions=captions, seeds=args.seeds, steps=steps, guidance=args.guidance,
                          probe_clips=1, on_attention=study.add)
    oracle = study.summary()
    for label, row in rows.items():
        sampled, predicted = harness["configs"][label], oracle["predicted"][label]
        row.update({key: sampled[key] for key in ("sparsity", "psnr", "ssim", "attention_s", "search_s")})
        row.update({"predicted_recall": predicted["recall_mean"], "oracle_recall": predicted["oracle_recall_mean"],
                    "probe_sparsity": predicted["sparsity_mean"]})
    return {"settings": harness["settings"], "oracle": oracle["oracle"]}


if __name__ == "__main__":
    main()
