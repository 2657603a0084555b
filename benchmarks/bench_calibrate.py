"""The cost of per-head calibration at the Wan2.1-1.3B size (issue 35: at most 10 minutes on the H200).

A random-weight diffusers ``WanTransformer3DModel`` of the Wan2.1-1.3B config (30 layers of 12 heads x 128,
built as ``bench_e2e`` builds it: bf16 on CUDA, the fp32 modules kept fp32) at 480p, 81 frames (latents 21 x 60 x
104, 32,760 tokens), is calibrated by the library's ``sparsevid.eval.calibrate.calibrate_heads`` (what
``sparsevid calibrate`` runs) on ``--inputs`` dense forwards (random latents and umT5-sized text states, the
timesteps spread over (0, 1000) as ``--data``'s noise-level bins spread them; ``--inputs 6`` is the command's
default of 2 triples x 3 bins), with the default candidate grid, then ``Calibration.choose`` at
``--target-sparsity`` and ``Calibration.save``.

Recorded, each phase timed apart (CUDA-synchronised wall clock): the dense forward alone (after a warm-up; the
measurement's unit of cost), the measurement (``calibrate_heads``: the forwards, every layer's exact tile masses
and every candidate's masks and outputs; seconds per input, the first one with the kernels' compilation), the
choice, the file's writing and its size, and the load: ``SparseConfig.from_calibration`` applied to the model
and one sparse forward with the calibrated per-head budgets (its achieved sparsity against the calibration's).
Peak GPU memory of the measurement and of the whole run. The measurement is bounded: an input starts only if, at
the pace of those before it, it ends within ``--budget-s`` seconds of measuring (the first always runs), and the
result says how many ran.

    python -m benchmarks calibrate_wan13b
    # CPU smoke run of the same code path (numbers meaningless):
    python -m benchmarks --results /tmp/r calibrate_wan13b --device cpu --dtype float32 --layers 2 --heads 2 \\
        --grid 2x16x16 --text-tokens 8 --inputs 2
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

import sparsevid as sv
from sparsevid.eval.calibrate import calibrate_heads

from .bench_e2e import MODELS, build_transformer, layer_breakdown, make_inputs, model_config, parse_grid, sync
from .report import write_result
from .run_info import run_metadata

MODEL = "wan1.3b"
ISSUE_TARGET_S = 600.0  # issue 35: a Wan-1.3B-size transformer calibrated in at most 10 minutes on the H200


def calibration_inputs(grid, count: int, device, dtype, text_tokens: int) -> list[dict]:
    """``count`` forward arguments (fresh random latents and text states), timestep of input i at
    1000 (i + 0.5) / count."""
    generator = torch.Generator().manual_seed(0)
    inputs = [make_inputs(grid, device, dtype, generator, text_tokens) for _ in range(count)]
    for i, entry in enumerate(inputs):
        entry["timestep"] = torch.tensor([1000.0 * (i + 0.5) / count], device=device)
    return inputs


class Timer:
    """Wall-clock seconds of a block on ``device`` (synchronised before and after)."""

    def __init__(self, device: torch.device):
        self.device, self.seconds = device, 0.0

    def __enter__(self):
        sync(self.device)
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        sync(self.device)
        self.seconds = time.perf_counter() - self.start


def bounded_forwards(model, inputs: list[dict], budget_s: float, device, log: list[float]):
    """The forwards ``calibrate_heads`` runs, one per input, each timed into ``log`` and printed; an input starts
    only if it would end within ``budget_s`` seconds of the first one's start at the mean pace so far (the first
    always runs)."""
    start = time.perf_counter()
    for i, entry in enumerate(inputs):
        if i and time.perf_counter() - start + sum(log) / len(log) > budget_s:
            print(f"calibrate: input {i + 1} would end past the budget of {budget_s:.0f} s; {i} of {len(inputs)} "
                  f"inputs measured", flush=True)
            return

        def forward(entry=entry, i=i):
            with Timer(device) as timer:
                model(**entry)
            log.append(timer.seconds)
            print(f"calibrate: input {i + 1}/{len(inputs)} (t={float(entry['timestep']):.0f}) measured in "
                  f"{timer.seconds:.1f} s", flush=True)

        yield forward


def peak_gb(device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def reset_peak(device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def load_back(model, path: Path, inputs: dict, backend: str, device) -> dict:
    """The calibration file at ``path`` loaded with ``SparseConfig.from_calibration`` and applied to ``model``, then
    one sparse forward on ``inputs`` with stats: {"loads", "load_error" (None or the error), "load_s",
    "sparse_forward_s", "loaded_sparsity" (achieved, mean over layers), "per_head_layers" (layers with per-head
    budgets)}; the model is dense again after."""
    found = {"loads": False, "load_error": None, "load_s": None, "sparse_forward_s": None, "loaded_sparsity": None,
             "per_head_layers": None}
    try:
        with Timer(device) as load:
            sparse = sv.SparseConfig.from_calibration(path, backend=backend)
            sv.apply_sparse_attention(model, sparse)
        with torch.no_grad(), Timer(device) as forward:
            stats = layer_breakdown(model, inputs)
    except (ValueError, TypeError, RuntimeError) as error:
        return {**found, "load_error": f"{type(error).__name__}: {error}"}
    finally:
        if sv.is_sparse(model):
            sv.remove_sparse_attention(model)
    return {**found, "loads": True, "load_s": load.seconds, "sparse_forward_s": forward.seconds,
            "loaded_sparsity": stats["sparsity"],
            "per_head_layers": sum(isinstance(o.get("topk"), list) for o in sparse.layer_overrides.values())}


def run(args, device, dtype) -> dict:
    """Build, time the dense forward, calibrate, choose, save and load (module docstring); the result's fields."""
    config, grid, tokens = model_config(MODEL, args)
    with Timer(device) as build:
        model = build_transformer(config, device, dtype)
    inputs = calibration_inputs(grid, args.inputs, device, dtype, args.text_tokens)
    print(f"built {MODELS[MODEL]['label']} ({config['num_layers']} layers x {config['num_attention_heads']} heads, "
          f"{tokens} tokens) in {build.seconds:.1f} s", flush=True)
    with torch.no_grad():
        model(**inputs[0])  # warm-up
        with Timer(device) as dense:
            model(**inputs[0])
    print(f"dense forward {dense.seconds:.2f} s", flush=True)

    reset_peak(device)
    per_input: list[float] = []
    with Timer(device) as measure:
        calibration = calibrate_heads(model, bounded_forwards(model, inputs, args.budget_s, device, per_input),
                                      block_q=args.block_q, block_k=args.block_k, tile=args.tile,
                                      backend=args.backend, inputs={"benchmark": "calibrate_wan13b"})
    measure_peak = peak_gb(device)
    with Timer(device) as choose:
        calibration.choose(target_sparsity=args.target_sparsity)
    summary = calibration.summary()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "sparse_calibration.json"
        with Timer(device) as save:
            calibration.save(path)
        size = path.stat().st_size
        loaded = load_back(model, path, inputs[0], args.backend, device)
    calibration_s = measure.seconds + choose.seconds + save.seconds
    load_s, sparse_forward_s = loaded.pop("load_s"), loaded.pop("sparse_forward_s")
    print(f"calibrated {len(per_input)} inputs in {measure.seconds:.1f} s (choose {choose.seconds:.3f} s, save "
          f"{save.seconds:.3f} s, {size / 1e3:.1f} kB); calibrated mean sparsity {summary['mean_sparsity']:.3f}; "
          f"loaded: {loaded['loaded_sparsity'] if loaded['loads'] else loaded['load_error']}", flush=True)
    return {
        "model": MODELS[MODEL]["label"], "layers": config["num_layers"], "heads": config["num_attention_heads"],
        "grid": list(grid), "tokens": tokens, "target_sparsity": args.target_sparsity,
        "candidates": len(calibration.candidates), "inputs_requested": args.inputs, "inputs_measured": len(per_input),
        "calls_per_layer": calibration.inputs["calls_per_layer"],
        "seconds": {"build": build.seconds, "dense_forward": dense.seconds, "measure": measure.seconds,
                    "measure_per_input": per_input, "choose": choose.seconds, "save": save.seconds,
                    "load_and_apply": load_s, "sparse_forward": sparse_forward_s,
                    "calibration": calibration_s},
        "measure_per_input_over_dense_forward": sum(per_input[1:] or per_input) / len(per_input[1:] or per_input)
        / dense.seconds,
        "peak_gpu_gb": {"measure": measure_peak, "run": peak_gb(device)},
        "file_bytes": size, **loaded,
        "calibrated": {k: summary[f"mean_{k}"] for k in ("sparsity", "error", "recall")},
        "issue_target_s": ISSUE_TARGET_S,
        "within_issue_target": calibration_s <= ISSUE_TARGET_S and len(per_input) == args.inputs}


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(r: dict) -> str:
    s = r["seconds"]
    per_input = ", ".join(f"{x:.1f}" for x in s["measure_per_input"])
    lines = [f"{r['model']} random weights, {r['layers']} layers x {r['heads']} heads, {r['tokens']} tokens; "
             f"{r['candidates']} candidates, target sparsity {r['target_sparsity']}; {r['inputs_measured']} of "
             f"{r['inputs_requested']} inputs measured.", "",
             "| phase | seconds |", "|---|---|",
             f"| build the model | {s['build']:.1f} |", f"| dense forward (one input) | {s['dense_forward']:.2f} |",
             f"| measure (calibrate_heads; per input: {per_input}) | {s['measure']:.1f} |",
             f"| choose | {s['choose']:.3f} |", f"| save | {s['save']:.3f} |",
             f"| load (from_calibration + apply) | {_fmt(s['load_and_apply'], '.3f')} |",
             f"| sparse forward with the loaded budgets | {_fmt(s['sparse_forward'], '.2f')} |",
             f"| **calibration (measure + choose + save)** | **{s['calibration']:.1f}** |", "",
             f"Measurement per input: {r['measure_per_input_over_dense_forward']:.1f} dense forwards. Peak GPU memory: "
             f"{_fmt(r['peak_gpu_gb']['measure'], '.1f')} GB measuring, {_fmt(r['peak_gpu_gb']['run'], '.1f')} GB "
             f"in all. File {r['file_bytes'] / 1e3:.1f} kB. " + (
                 f"Loads with SparseConfig.from_calibration: yes ({r['per_head_layers']} of {r['layers']} layers with "
                 f"per-head budgets); sparsity {r['loaded_sparsity']:.3f} on input 1" if r["loads"] else
                 f"Loads with SparseConfig.from_calibration: **no** ({r['load_error']})")
             + f" against the calibration's mean {r['calibrated']['sparsity']:.3f} (mean error "
             f"{r['calibrated']['error']:.4f}, recall {r['calibrated']['recall']:.3f}).",
             f"Issue 35's target (at most {r['issue_target_s']:.0f} s, every input measured): "
             f"**{'met' if r['within_issue_target'] else 'not met'}**."]
    return "\n".join(lines) + "\n"


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}")
    return value


def _target(text: str) -> float:
    value = float(text)
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"must be a sparsity in (0, 1), got {text!r}")
    return value


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path,
                        help="folder of the result (<gpu>.json/.md); python -m benchmarks sets it")
    parser.add_argument("--inputs", type=_positive_int, default=6, help="dense forwards measured")
    parser.add_argument("--target-sparsity", type=_target, default=0.95)
    parser.add_argument("--budget-s", type=float, default=420.0,
                        help="an input is measured only if it would end within this many seconds of measuring")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--backend", default="auto", choices=["auto", "triton", "gather", "reference"])
    parser.add_argument("--block-q", type=int, default=128, choices=(64, 128))
    parser.add_argument("--block-k", type=int, default=64, choices=(64, 128))
    parser.add_argument("--tile", default="auto", help="'auto', 'none' or t,h,w")
    parser.add_argument("--text-tokens", type=_positive_int, default=512, help="text states per input")
    parser.add_argument("--layers", type=int, default=0, help="override the number of layers (shrink)")
    parser.add_argument("--heads", type=int, default=0, help="override the number of heads (shrink)")
    parser.add_argument("--grid", type=parse_grid, default=None, help="override the latent token grid TxHxW (shrink)")
    args = parser.parse_args(argv)
    if args.tile not in ("auto", "none"):
        args.tile = tuple(int(t) for t in args.tile.split(","))
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    result = run(args, device, dtype)
    meta = run_metadata(device, dtype=args.dtype, backend=args.backend, block_q=args.block_q, block_k=args.block_k,
                        tile=args.tile, budget_s=args.budget_s)
    text = table(result)
    write_result(args.out, meta, result, text)
    print(json.dumps(meta))
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
