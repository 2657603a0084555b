"""Training-free sparse attention on the built-in model: per-step prediction vs growing sparsity vs growing
sparsity with mask reuse and exact refreshes, all at the same mean sparsity.

Three settings of the top-k rule (its sparsity does not depend on the clip, so one calibration clip fixes
the sparsity of every clip):

* ``per-step``: a constant ``topk``, a mask predicted afresh at every step;
* ``growing``: the first ``--dense-steps`` steps dense, then ``topk`` falls from a start budget to
  ``--final-topk`` along ``--schedule``;
* ``growing+reuse+exact``: ``growing`` with ``refresh_interval=--refresh-interval`` and
  ``refresh_search="exact"`` (masks reused between refreshes, a refresh chosen from the exact tile masses).

Calibration: each setting's free budget (``per-step``: topk; the growing ones: the start topk) is bisected on
the first caption and seed until the mean sparsity over all self-attention calls of the sampling run
(dense calls count 0) is within ``--tolerance`` of ``--sparsity``.

Measurement: the quality harness (``sparsevid_lab.eval.harness.run_harness``) samples every caption x seed
densely and under each setting, plus ``dense``, every step dense through the sparse processors so that its
attention is timed the same way. Per setting: mean sparsity, PSNR / SSIM against the dense clips, attention
recall and relative L1 on the dense run's q, k, v at every step of the first ``--probe-clips`` clips (masks
predicted afresh at each step's budget), the time of all self-attention calls (``attention_ms`` of the
stats, CUDA events on a GPU, search included), the search time (``predict_ms``) and the sampling wall time.

Writes results.json, table.md and first_clip.{gif,png} (dense, then each setting) under --out.

    python -m sparsevid_lab.studies.training_free_quality --out lab/results/training_free_quality_h200
    # CPU check of the same code path (an untrained tiny model; timings meaningless):
    python -m sparsevid_lab.studies.training_free_quality --out /tmp/tfq --tiny --device cpu --captions 2 --seeds 0 \\
        --steps 6 --sparsity 0.5 --final-topk 0.25 --refresh-interval 2 --tolerance 0.1
"""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

import sparsevid as sv
from benchmarks.run_info import recorded_args, run_metadata
from ..eval.harness import (DEFAULT_CAPTIONS, run_harness, sample_with_stats, summarize_calls,
                                    timed_generate)

DENSE = "dense (stats)"  # the harness keeps its own plain dense clips under "dense"


@dataclass
class Setting:
    """A sparse setting with one free budget ``knob`` in [low, high]; a larger budget means less sparsity.
    ``flags``: the options that move the mean sparsity it can reach (for the error when it cannot)."""

    label: str
    knob: str
    make: Callable[[float], sv.SparseConfig]
    low: float
    flags: str
    high: float = 1.0


def settings(args, steps: int) -> list[Setting]:
    """The three compared settings (see the module docstring)."""
    def growing(reuse: bool) -> Callable[[float], sv.SparseConfig]:
        extra = {"refresh_interval": args.refresh_interval, "refresh_search": "exact"} if reuse else {}
        return lambda start: sv.SparseConfig(rule="topk", topk=start, final_topk=args.final_topk,
                                             schedule=args.schedule, num_steps=steps,
                                             dense_steps=args.dense_steps, **extra)

    flags = "--sparsity, --tolerance, --dense-steps or --final-topk"
    return [Setting("per-step", "topk", lambda topk: sv.SparseConfig(rule="topk", topk=topk), low=1e-3,
                    flags="--sparsity or --tolerance"),
            Setting("growing", "start topk", growing(False), low=args.final_topk, flags=flags),
            Setting("growing+reuse+exact", "start topk", growing(True), low=args.final_topk, flags=flags)]


def calibrate(setting: Setting, measure: Callable[[sv.SparseConfig], float], target: float, tolerance: float,
              iterations: int) -> dict:
    """Bisect ``setting``'s budget until ``measure`` (mean sparsity) is within ``tolerance / 2`` of ``target``
    or ``iterations`` ran; keep the closest. SystemExit when even that misses ``target`` by more than
    ``tolerance``."""
    low, high, trials = setting.low, setting.high, []
    for _ in range(iterations):
        value = (low + high) / 2
        sparsity = measure(setting.make(value))
        trials.append({"value": value, "sparsity": sparsity})
        print(f"  {setting.label:20s} {setting.knob} {value:.4f}: mean sparsity {sparsity:.4f}", flush=True)
        if abs(sparsity - target) <= tolerance / 2:
            break
        low, high = (value, high) if sparsity > target else (low, value)
    best = min(trials, key=lambda t: abs(t["sparsity"] - target))
    if abs(best["sparsity"] - target) > tolerance:
        reached = ", ".join(f"{t['sparsity']:.3f}" for t in trials)
        raise SystemExit(f"error: {setting.label}: no {setting.knob} in [{setting.low}, {setting.high}] reaches "
                         f"mean sparsity {target} within --tolerance {tolerance} (measured {reached}); "
                         f"change {setting.flags}")
    return {"knob": setting.knob, **best, "trials": trials}


def describe(config: sv.SparseConfig, steps: int) -> str:
    """The budget of a setting over a ``steps``-step run in a few words."""
    if config.dense_steps >= steps:
        return "every step dense"
    if config.schedule == "constant":
        return f"topk {config.topk:.3f} every step"
    text = (f"{config.dense_steps} dense step{'s' * (config.dense_steps != 1)}, then topk {config.topk:.3f} -> "
            f"{config.final_topk:.3f} ({config.schedule})")
    if config.refresh_interval > 1:
        text += f", refresh every {config.refresh_interval} ({config.refresh_search})"
    return text


def table(results: dict) -> str:
    """Markdown: one row per setting, dense first."""
    s = results["settings"]
    dense = results["configs"][DENSE]
    lines = [f"{len(s['captions'])} captions x {len(s['seeds'])} seeds, {s['steps']} {s['scheduler']} steps, "
             f"guidance {s['guidance']}, {results['gpu']} (torch {results['torch']}, triton {results['triton']}, "
             f"commit {results['commit']}); target mean sparsity {results['target_sparsity']}",
             "",
             "| setting | budget | mean sparsity | PSNR (dB) | SSIM | recall | rel. L1 | attention s | search s | "
             "attention vs dense | sampling s | sampling vs dense |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in results["configs"].items():
        budget = describe(sv.SparseConfig.from_dict(r["config"]), s["steps"])
        lines.append(f"| {'dense' if name == DENSE else name} | {budget} | {r['sparsity']:.3f} | {r['psnr']:.2f} | "
                     f"{r['ssim']:.4f} | {r['recall']:.3f} | {r['rel_l1']:.3f} | {r['attention_s']:.3f} | "
                     f"{r['search_s']:.3f} | {dense['attention_s'] / r['attention_s']:.2f}x | {r['seconds']:.2f} | "
                     f"{r['speedup']:.2f}x |")
    lines += ["", "Sparse calls by mask source: " + "; ".join(
        f"{name}: {r['mask_sources']}" for name, r in results["configs"].items() if r["mask_sources"])]
    return "\n".join(lines) + "\n"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--sparsity", type=float, default=0.8, help="target mean sparsity of every setting")
    parser.add_argument("--tolerance", type=float, default=0.01, help="largest allowed |mean sparsity - target|")
    parser.add_argument("--bisect-steps", type=int, default=10, help="calibration: most measurements per setting")
    parser.add_argument("--dense-steps", type=int, default=1, help="growing settings: dense warm-up steps")
    parser.add_argument("--final-topk", type=float, default=0.05, help="growing settings: topk at the last step")
    parser.add_argument("--schedule", default="cosine", choices=["linear", "cosine", "snr"])
    parser.add_argument("--refresh-interval", type=int, default=3, help="reuse setting: steps per mask")
    parser.add_argument("--captions", type=int, default=4, help="how many of the harness captions")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--steps", type=int, default=None, help="sampler steps (default: the model's)")
    parser.add_argument("--guidance", type=float, default=None, help="default: the model's")
    parser.add_argument("--probe-clips", type=int, default=1, help="clips probed for recall at every step")
    parser.add_argument("--model", default=None, help="model directory (default: the shipped model)")
    parser.add_argument("--tiny", action="store_true", help="an untrained tiny model (check on the CPU)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    checks = [(0.0 < args.sparsity < 1.0, "--sparsity must be in (0, 1)"),
              (0.0 < args.tolerance < 1.0, "--tolerance must be in (0, 1)"),
              (args.bisect_steps >= 1, "--bisect-steps must be >= 1"),
              (args.dense_steps >= 0, "--dense-steps must be >= 0"),
              (0.0 < args.final_topk <= 1.0, "--final-topk must be a fraction in (0, 1]"),
              (args.refresh_interval >= 2, "--refresh-interval must be >= 2 (1 would not reuse masks)"),
              (1 <= args.captions <= len(DEFAULT_CAPTIONS), f"--captions must be in [1, {len(DEFAULT_CAPTIONS)}]"),
              (args.steps is None or args.steps >= 1, "--steps must be >= 1"),
              (args.probe_clips >= 1, "--probe-clips must be >= 1")]
    for ok, message in checks:
        if not ok:
            parser.error(message)
    return args


def main(argv=None) -> None:
    from ..cli.demo import load_model
    from ..eval.media import write_clips

    args = parse_args(argv)
    model = load_model(args)
    steps = args.steps or model.config["sampling"]["steps"]
    if args.dense_steps >= steps:
        raise SystemExit(f"error: --dense-steps ({args.dense_steps}) must be below the number of steps ({steps})")
    captions = [c for c in DEFAULT_CAPTIONS if model.data.fits(c)][: args.captions]
    device = next(model.parameters()).device
    print(f"device {device}, {len(captions)} captions x {len(args.seeds)} seeds, {steps} steps; calibrating to "
          f"mean sparsity {args.sparsity} on the first clip", flush=True)
    first = [(captions[0], args.seeds[0])]
    timed_generate(model, [first[0][0]], [first[0][1]], steps, args.guidance)  # warm-up of dense sampling

    def measure(config: sv.SparseConfig) -> float:
        return summarize_calls(sample_with_stats(model, config, first, steps, args.guidance)[2])["sparsity"]

    configs, calibration = {DENSE: sv.SparseConfig(dense_steps=steps)}, {}
    for setting in settings(args, steps):
        calibration[setting.label] = calibrate(setting, measure, args.sparsity, args.tolerance, args.bisect_steps)
        configs[setting.label] = setting.make(calibration[setting.label]["value"])
    results = run_harness(model, configs, captions=captions, seeds=args.seeds, steps=steps, guidance=args.guidance,
                          probe_steps=range(steps), probe_clips=args.probe_clips)
    clips = results.pop("clips")
    results["settings"]["scheduler"] = model.config["sampling"]["scheduler"]
    results.update({**run_metadata(device), "target_sparsity": args.sparsity, "tolerance": args.tolerance,
                    "calibration": calibration, "args": recorded_args(args)})
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    (args.out / "table.md").write_text(table(results))
    write_clips([clips[name][0] for name in clips if name != DENSE], args.out / "first_clip")
    print(table(results))
    print(f"wrote {args.out / 'results.json'}, {args.out / 'table.md'}, {args.out / 'first_clip.png'}")


if __name__ == "__main__":
    main()
