"""Training-free mode benchmark: the forward kernel with exact tile masses, and a full denoising loop.

1. Kernel: block-sparse forward on the Wan2.1-1.3B 480p attention shape (B=1, H=12, N=32760, D=128, bf16) at
   the given sparsities, plain vs ``return_tile_mass=True`` (median ms, overhead; target <= 10% at 95%),
   each the median of KERNEL_ROUNDS alternated timings (one on the CPU), with a check of the masses against
   float64 on a few query blocks.
2. Loop: a ``--steps``-step generation (``--cfg-passes`` transformer calls per step, flow-matching timesteps
   with ``--shift``) of the Wan2.1-1.3B transformer built from its config with random weights (as
   bench_e2e.py), dense vs the training-free schedule (dense warm-up steps, growing sparsity, mask reuse and
   reduced search) vs a constant sparse config predicting every step. Wall time of the whole loop, search
   included; a second pass with stats gives the search (mask prediction) time per step, the mask sources
   and the sparsity per step.

Writes its result (rows, Markdown table) under --out.

    python -m benchmarks training_free      # tile_mass: the kernel part alone
    # CPU check of the same code paths (Triton interpreted for the kernel part):
    python -m benchmarks --results /tmp/tf training_free --device cpu --dtype float32 --heads 2 \
        --tokens 1000 --grid 3x8x8 --layers 2 --steps 8 --dense-steps 1 --refresh-interval 2 --iters 1
"""
from __future__ import annotations

import argparse
import collections
import json
import math
import os
import statistics
import sys
import time

import torch

def _cpu_requested(argv: list[str]) -> bool:
    return "--device=cpu" in argv or any(a == "--device" and b == "cpu" for a, b in zip(argv, argv[1:]))


if _cpu_requested(sys.argv):
    os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton kernels run interpreted; set before they are imported

import sparsevid as sv  # noqa: E402
from .bench_e2e import (MODELS, build_transformer, dense_sdpa_context, make_inputs,  # noqa: E402
                                  parse_grid, sync)
from .report import write_result  # noqa: E402
from .run_info import recorded_args, run_metadata  # noqa: E402
from .timing import cuda_kernel_ms, median_ms  # noqa: E402

KERNEL_ROUNDS = 5


def check_masses(q, k, mask, mass, blocks: int = 2) -> float:
    """Max |mass - float64 mass| over the first ``blocks`` query blocks of every head."""
    rows = min(blocks * mask.block_q, q.shape[2])
    scores = (q[:, :, :rows].double() @ k.double().transpose(-1, -2)) * q.shape[-1] ** -0.5
    keep = mask.keep[:, :, :blocks].repeat_interleave(mask.block_q, 2)[:, :, :rows]
    keep = keep.repeat_interleave(mask.block_k, 3)[..., : k.shape[2]]
    probs = torch.softmax(scores.masked_fill(~keep, float("-inf")), -1).nan_to_num(0.0)
    kb = mask.num_kv_blocks
    probs = torch.nn.functional.pad(probs, (0, kb * mask.block_k - k.shape[2]))
    per_row = probs.unflatten(-1, (kb, mask.block_k)).sum(-1)
    expected = torch.stack([per_row[:, :, i * mask.block_q:(i + 1) * mask.block_q].mean(2)
                            for i in range(-(-rows // mask.block_q))], dim=2)
    return float((mass[:, :, : expected.shape[2]].double() - expected).abs().max())


def bench_kernel(args, device, dtype) -> list[dict]:
    heads, n, d = args.heads or 12, args.tokens, 128
    backend = "triton" if device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1" else "reference"
    timing = {"device": device, "reps": args.iters, "rep_ms": max(50, 20 * args.iters)}
    rounds = KERNEL_ROUNDS if device.type == "cuda" else 1
    rows = []
    for sparsity in args.sparsities:
        gen = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, heads, n, d, generator=gen).to(device, dtype) for _ in range(3))
        mask = sv.random_block_mask(1, heads, n, n, sparsity, 128, 64, generator=gen, device=device)
        def plain_call():
            return sv.block_sparse_attention(q, k, v, mask, backend=backend)

        def mass_call():
            return sv.block_sparse_attention(q, k, v, mask, backend=backend, return_tile_mass=True)

        plain_runs, mass_runs = [], []
        for _ in range(rounds):  # alternated, so that drifts of the GPU clock hit both alike
            plain_runs.append(median_ms(plain_call, **timing))
            mass_runs.append(median_ms(mass_call, **timing))
        plain, with_mass = statistics.median(plain_runs), statistics.median(mass_runs)
        _, mass = mass_call()
        breakdown = {}
        if device.type == "cuda":  # the kernels each timing is made of
            breakdown = {"plain": cuda_kernel_ms(plain_call), "with_tile_mass": cuda_kernel_ms(mass_call)}
            print(f"kernel ms per call at {sparsity:.2f}: {json.dumps(breakdown)}", flush=True)
        row_sums = mass.double().sum(-1)
        rows.append({"heads": heads, "tokens": n, "head_dim": d, "dtype": str(dtype), "backend": backend,
                     "target_sparsity": sparsity, "sparsity": mask.sparsity, "forward_ms": plain,
                     "forward_with_tile_mass_ms": with_mass, "overhead": with_mass / plain - 1.0,
                     "rounds_ms": {"plain": plain_runs, "with_tile_mass": mass_runs},
                     "mass_row_sum_max_error": float((row_sums - 1).abs().max()),
                     "mass_max_error_vs_float64": check_masses(q, k, mask, mass),
                     "cuda_kernel_ms": breakdown})
        print(f"kernel sparsity {sparsity:.2f}: {plain:.3f} ms, with tile masses {with_mass:.3f} ms "
              f"(+{rows[-1]['overhead']:.1%})", flush=True)
    return rows


def flow_timesteps(steps: int, shift: float) -> list[float]:
    """Flow-matching timesteps (sigma * 1000, shifted as diffusers' FlowMatch schedulers do)."""
    sigmas = [1.0 - i / steps for i in range(steps)]
    return [1000.0 * shift * s / (1 + (shift - 1) * s) for s in sigmas]


def configs(args, layers: int) -> dict[str, sv.SparseConfig | None]:
    common = {"block_q": 128, "block_k": 64, "backend": args.backend, "rule": args.rule}
    training_free = sv.SparseConfig(
        **common, topk=args.topk, topp=args.topp, final_topk=args.final_topk, final_topp=args.final_topp,
        schedule=args.schedule, num_steps=args.steps, dense_steps=args.dense_steps,
        refresh_interval=args.refresh_interval, refresh_search=args.refresh_search)
    final = {"topk": args.final_topk or args.topk, "topp": args.final_topp or args.topp}
    constant = sv.SparseConfig(**common, **final, dense_steps=args.dense_steps)
    return {"dense": None, "training-free": training_free, "constant sparse": constant}


def generate(model, passes, timesteps, collect: bool = False) -> list[dict]:
    """One generation: every step calls the transformer once per pass (conditional, unconditional)."""
    per_step = []
    for t in timesteps:
        stats = []
        for inputs in passes:
            model(**inputs, timestep=torch.tensor([t], device=inputs["hidden_states"].device))
            if collect:
                stats += sv.attention_stats(model)
        per_step.append(stats)
    return per_step


def step_summary(stats: list[dict]) -> dict:
    sparse = [s for s in stats if not s["dense"]]
    sources = collections.Counter(s.get("mask_source") for s in sparse)
    return {"search_ms": sum(s["predict_ms"] or 0.0 for s in sparse),
            "attention_ms": sum(s["attention_ms"] or 0.0 for s in stats),
            "sparsity": statistics.fmean(s["sparsity"] for s in stats) if stats else 0.0,
            "mask_sources": dict(sources)}


def bench_loop(args, device, dtype) -> list[dict]:
    spec = MODELS["wan1.3b"]
    config = dict(spec["config"])
    config.update({k: v for k, v in (("num_layers", args.layers), ("num_attention_heads", args.heads)) if v})
    grid = args.grid or spec["grid"]
    gen = torch.Generator().manual_seed(0)
    model = build_transformer(config, device, dtype)
    passes = [make_inputs(grid, device, dtype, gen) for _ in range(args.cfg_passes)]
    for inputs in passes:
        inputs.pop("timestep")
    timesteps = flow_timesteps(args.steps, args.shift)
    warm = timesteps[: min(args.steps, args.dense_steps + args.refresh_interval + 2)]
    rows = []
    with torch.no_grad(), dense_sdpa_context(device, args.dense_backend):
        for label, cfg in configs(args, config["num_layers"]).items():
            if label not in args.settings:
                continue
            if cfg is not None:
                sv.apply_sparse_attention(model, cfg)
            generate(model, passes, warm)              # autotuning, every mask source once
            sync(device)
            start = time.perf_counter()
            generate(model, passes, timesteps)
            sync(device)
            total_s = time.perf_counter() - start
            steps = []
            if cfg is not None:
                sv.set_collect_stats(model, True)
                steps = [step_summary(s) for s in generate(model, passes, timesteps, collect=True)]
                sv.remove_sparse_attention(model)
            rows.append({"setting": label, "config": None if cfg is None else cfg.to_dict(), "grid": list(grid),
                         "layers": config["num_layers"], "heads": config["num_attention_heads"],
                         "steps": args.steps, "cfg_passes": args.cfg_passes, "generation_s": total_s,
                         "search_s": sum(s["search_ms"] for s in steps) / 1e3, "per_step": steps,
                         "mean_sparsity": statistics.fmean(s["sparsity"] for s in steps) if steps else 0.0})
            print(f"loop {label:16s} {total_s:8.2f} s  search {rows[-1]['search_s']:.3f} s  "
                  f"mean sparsity {rows[-1]['mean_sparsity']:.3f}", flush=True)
    for row in rows:
        row["speedup"] = rows[0]["generation_s"] / row["generation_s"]
    return rows


def table(kernel_rows, loop_rows) -> str:
    lines = []
    if kernel_rows:
        lines += ["| sparsity | forward ms | with tile masses ms | overhead | mass error vs fp64 |",
                  "|---|---|---|---|---|"]
        lines += [f"| {r['sparsity']:.3f} | {r['forward_ms']:.3f} | {r['forward_with_tile_mass_ms']:.3f} | "
                  f"{r['overhead']:+.1%} | {r['mass_max_error_vs_float64']:.1e} |" for r in kernel_rows]
    if loop_rows:
        lines += ["", "| setting | generation s | speedup | search s | mean sparsity |", "|---|---|---|---|---|"]
    lines += [f"| {r['setting']} | {r['generation_s']:.2f} | {r['speedup']:.2f}x | {r['search_s']:.3f} | "
              f"{r['mean_sparsity']:.3f} |" for r in loop_rows]
    for r in loop_rows:
        if r["per_step"]:
            lines += ["", f"{r['setting']}, per step: search ms / sparsity / mask sources", ""]
            lines += [f"- step {i}: {s['search_ms']:.2f} ms, {s['sparsity']:.3f}, {s['mask_sources']}"
                      for i, s in enumerate(r["per_step"])]
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True,
                        help="folder of the result (<gpu>.json/.md); python -m benchmarks sets it")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--parts", default="kernel,loop", help="comma list of kernel, loop")
    parser.add_argument("--settings", default="dense,training-free,constant sparse",
                        help="loop part: comma list of dense, training-free, constant sparse")
    parser.add_argument("--sparsities", default="0.95,0.9", help="kernel part: comma list")
    parser.add_argument("--tokens", type=int, default=32760, help="kernel part: sequence length")
    parser.add_argument("--heads", type=int, default=0, help="override the number of heads (shrink)")
    parser.add_argument("--layers", type=int, default=0, help="override the number of layers (shrink)")
    parser.add_argument("--grid", type=parse_grid, default=None, help="override the latent grid TxHxW (shrink)")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--cfg-passes", type=int, default=2)
    parser.add_argument("--shift", type=float, default=3.0, help="flow-matching timestep shift (Wan 480p: 3)")
    parser.add_argument("--backend", default="auto", choices=["auto", "triton", "reference"])
    parser.add_argument("--dense-backend", default="cudnn", choices=["cudnn", "flash", "default"])
    parser.add_argument("--rule", default="topk", choices=["topk", "topp", "hybrid"])
    parser.add_argument("--topk", type=float, default=0.15)
    parser.add_argument("--final-topk", type=float, default=0.05)
    parser.add_argument("--topp", type=float, default=0.95)
    parser.add_argument("--final-topp", type=float, default=None)
    parser.add_argument("--schedule", default="cosine", choices=["linear", "cosine", "snr"])
    parser.add_argument("--dense-steps", type=int, default=5)
    parser.add_argument("--refresh-interval", type=int, default=5)
    parser.add_argument("--refresh-search", default="exact", choices=["full", "within", "exact"])
    args = parser.parse_args(argv)
    args.sparsities = [float(s) for s in args.sparsities.split(",")]
    args.settings = args.settings.split(",")
    unknown = set(args.settings) - {"dense", "training-free", "constant sparse"}
    if unknown or "dense" not in args.settings:
        parser.error(f"--settings: a comma list of dense, training-free, constant sparse that includes dense, got "
                     f"{sorted(unknown) or args.settings}")
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    parts = set(args.parts.split(","))
    result = {"args": recorded_args(args),
              "kernel": bench_kernel(args, device, dtype) if "kernel" in parts else [],
              "loop": bench_loop(args, device, dtype) if "loop" in parts else []}
    text = table(result["kernel"], result["loop"])
    write_result(args.out, run_metadata(device), result, text)
    print(text)
    if any(not math.isfinite(r["overhead"]) for r in result["kernel"]):
        raise SystemExit("non-finite kernel timings")


if __name__ == "__main__":
    main()
