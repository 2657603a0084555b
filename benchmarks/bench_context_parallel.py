"""Sequence-parallel sparse attention: the Wan2.1 transformer forward on one GPU and over all ranks (Ulysses).

One launch measures the whole table (the one-GPU rows run on rank 0 while the other ranks wait):

    torchrun --nproc-per-node 2 -m benchmarks context_parallel

(a) Correctness: a shrunk Wan2.1-1.3B (480p, 32,760 tokens, --check-layers layers, random bf16 weights, the
    same on every rank): the sparse output over the ranks against the sparse output on one GPU, and dense the
    same way (diffusers' own context parallelism with cuDNN SDPA). The dense gap is the rounding that splitting
    the sequence causes by itself; the sparse gap must stay within twice it, or within the dtype's epsilon.
(b) Timing: Wan2.1-14B 720p (75,600 tokens, random bf16 weights), 1 warm-up + --iters timed forwards each:
    dense on 1 GPU (cuDNN SDPA), sparse 95% on 1 GPU, dense and sparse 95% over the ranks (Ulysses). A
    multi-rank time is the slowest rank's.

Writes its result (check, rows, Markdown table) under --out and prints the table. With --nproc-per-node 1 only
the one-GPU rows are measured. CPU check of the same code path (gloo, tiny shapes, float32):

    torchrun --nproc-per-node 2 -m benchmarks --results /tmp/cp context_parallel --tiny
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
from pathlib import Path

import torch
import torch.distributed as dist

import sparsevid as sv
from .bench_e2e import (MODELS, build_transformer, dense_sdpa_context, make_inputs, model_config,
                                  time_forward)
from .report import write_result
from .run_info import run_metadata

TINY = {"layers": 2, "heads": 2, "grid": (3, 8, 8)}  # --tiny: every model shrunk to this (192 tokens)


def setup(tiny: bool) -> tuple[torch.device, int, int]:
    """Join the torchrun process group (NCCL on GPUs, gloo for --tiny); returns (device, rank, world size)."""
    dist.init_process_group("gloo" if tiny else "nccl")
    if tiny:
        torch.accelerator.device_count = lambda: 1  # diffusers picks device rank % count; a CPU host counts 0
        return torch.device("cpu"), dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    return device, dist.get_rank(), dist.get_world_size()


def shrink(args, layers: int = 0) -> argparse.Namespace:
    """The --layers/--heads/--grid overrides of ``bench_e2e.model_config``: --tiny's, or ``layers`` alone."""
    return argparse.Namespace(**TINY) if args.tiny else argparse.Namespace(layers=layers, heads=0, grid=None)


def sparse_config(args) -> sv.SparseConfig:
    return sv.SparseConfig(rule="topk", topk=round(1.0 - args.sparsity, 6), block_q=args.block_q,
                           block_k=args.block_k, backend=args.backend)


def enable_ulysses(model, world: int) -> None:
    from diffusers import ContextParallelConfig

    model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=world))


def free(device) -> None:
    gc.collect()  # diffusers' hook registries and the model refer to each other
    if device.type == "cuda":
        torch.cuda.empty_cache()


@torch.no_grad()
def forward(model, inputs) -> torch.Tensor:
    return model(**inputs)[0].float()


def gap(out: torch.Tensor, ref: torch.Tensor) -> dict:
    diff = (out - ref).abs()
    return {"max_abs": float(diff.max()), "mean_abs": float(diff.mean()), "rel": float(diff.norm() / ref.norm())}


def check(args, device, dtype, rank: int, world: int) -> dict | None:
    """(a): sparse and dense outputs over the ranks against one GPU; None on ranks > 0 or with one rank."""
    if world == 1:
        return None
    config, grid, tokens = model_config("wan1.3b", shrink(args, args.check_layers))
    torch.manual_seed(0)
    model = build_transformer(config, device, dtype)
    for param in model.parameters():
        dist.broadcast(param.data, src=0)
    inputs = make_inputs(grid, device, dtype, torch.Generator().manual_seed(1))
    cfg = sparse_config(args)
    one = {}
    with dense_sdpa_context(device, "cudnn"):
        if rank == 0:
            one["dense"] = forward(model, inputs)
            sv.apply_sparse_attention(model, cfg)
            one["sparse"] = forward(model, inputs)
            sv.remove_sparse_attention(model)
        dist.barrier()
        enable_ulysses(model, world)
        dense = forward(model, inputs)
        sv.apply_sparse_attention(model, cfg)
        sparse = forward(model, inputs)
    del model
    free(device)
    if rank != 0:
        return None
    result = {"model": f"{MODELS['wan1.3b']['label']} config, {config['num_layers']} layers", "tokens": tokens,
              "gpus": world, "dense": gap(dense, one["dense"]), "sparse": gap(sparse, one["sparse"])}
    result["budget_rel"] = max(2 * result["dense"]["rel"], torch.finfo(dtype).eps)
    result["within_budget"] = result["sparse"]["rel"] <= result["budget_rel"]
    print(f"check over {world} GPUs: relative error dense {result['dense']['rel']:.3g}, "
          f"sparse {result['sparse']['rel']:.3g}", flush=True)
    return result


def timed(model, inputs_list, args, device, world: int) -> dict:
    """Median forward ms (the slowest rank's per iteration) and the achieved sparsity (warm-up forward)."""
    sparse = sv.is_sparse(model)
    if sparse:
        sv.set_collect_stats(model, True)
    with torch.no_grad():
        model(**inputs_list[0])
    sparsity = None
    if sparse:
        sparsity = statistics.fmean(s["sparsity"] for s in sv.attention_stats(model))
        sv.set_collect_stats(model, False)
    with torch.no_grad():
        times = time_forward(model, inputs_list, 0, args.iters, device)
    stats = torch.tensor([*times, sparsity or 0.0], dtype=torch.float64, device=device)
    if world > 1:  # each rank's sparsity covers its own heads, equally many: the mean is the model's
        slowest, mean = stats.clone(), stats.clone()
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        dist.all_reduce(mean)
        stats = torch.cat([slowest[:-1], mean[-1:] / world])
    times = stats[:-1].tolist()
    return {"gpus": world, "forward_ms": statistics.median(times), "forward_ms_all": times,
            "achieved_sparsity": float(stats[-1]) if sparse else None}


def measure(model, inputs_list, args, device, gpus: int) -> list[dict]:
    """The dense and the sparse row of ``model`` on ``gpus`` ranks (as the model is parallel or not)."""
    rows = [{"setting": "dense", **timed(model, inputs_list, args, device, gpus)}]
    sv.apply_sparse_attention(model, sparse_config(args))
    rows.append({"setting": f"sparse {args.sparsity:.0%}", **timed(model, inputs_list, args, device, gpus)})
    sv.remove_sparse_attention(model)
    if dist.get_rank() == 0:
        for row in rows:
            print(f"{row['setting']:11s} on {gpus} GPU(s): forward {row['forward_ms']:10.1f} ms", flush=True)
    return rows


def timings(args, device, dtype, rank: int, world: int) -> list[dict]:
    """(b): the Wan2.1-14B 720p forward, dense and sparse, on rank 0 alone and then over every rank; the rows
    on rank 0, [] elsewhere."""
    config, grid, tokens = model_config("wan14b", shrink(args))
    torch.manual_seed(0)
    model = build_transformer(config, device, dtype)
    generator = torch.Generator().manual_seed(2)
    inputs_list = [make_inputs(grid, device, dtype, generator) for _ in range(2)]
    rows = []
    with dense_sdpa_context(device, "cudnn"):
        if rank == 0:
            rows += measure(model, inputs_list, args, device, 1)
        if world > 1:
            dist.barrier()
            enable_ulysses(model, world)
            rows += measure(model, inputs_list, args, device, world)
    del model
    free(device)
    if rank != 0:
        return []
    for row in rows:
        row.update(model=MODELS["wan14b"]["label"] + (" (shrunk)" if args.tiny else ""), tokens=tokens,
                   layers=config["num_layers"], heads=config["num_attention_heads"],
                   config=sparse_config(args).to_dict())
        same_one = next(r["forward_ms"] for r in rows if r["setting"] == row["setting"] and r["gpus"] == 1)
        row["speedup_vs_dense_1gpu"] = rows[0]["forward_ms"] / row["forward_ms"]
        row["speedup_vs_same_1gpu"] = same_one / row["forward_ms"]
    return rows


def fmt(value, spec):
    return "-" if value is None else format(value, spec)


def table(rows: list[dict], checked: dict | None) -> str:
    lines = ["| model | tokens | attention | GPUs | forward ms | vs dense 1 GPU | vs same attention on 1 GPU | "
             "achieved sparsity |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['tokens']} | {r['setting']} | {r['gpus']} | {r['forward_ms']:.1f} | "
                     f"{r['speedup_vs_dense_1gpu']:.2f}x | {r['speedup_vs_same_1gpu']:.2f}x | "
                     f"{fmt(r['achieved_sparsity'], '.3f')} |")
    if checked is not None:
        lines += ["", f"Output over {checked['gpus']} GPUs against 1 GPU ({checked['model']}, {checked['tokens']} "
                      f"tokens):", "", "| attention | max abs error | mean abs error | relative error |",
                  "|---|---|---|---|"]
        for kind in ("dense", "sparse"):
            g = checked[kind]
            lines.append(f"| {kind} | {g['max_abs']:.3g} | {g['mean_abs']:.3g} | {g['rel']:.3g} |")
        verdict = "within" if checked["within_budget"] else "OUTSIDE"
        lines += ["", f"Sparse relative error {checked['sparse']['rel']:.3g}: {verdict} the budget "
                      f"{checked['budget_rel']:.3g} (twice the dense error, at least the dtype's epsilon)."]
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path,
                        help="folder of the result (<gpu>.json/.md); python -m benchmarks sets it")
    parser.add_argument("--tiny", action="store_true", help="CPU (gloo), float32, every model shrunk to 192 tokens")
    parser.add_argument("--sparsity", type=float, default=0.95, help="target sparsity (top-k of key blocks)")
    parser.add_argument("--backend", default="auto", choices=["auto", "triton", "flex", "reference"])
    parser.add_argument("--block-q", type=int, default=128)
    parser.add_argument("--block-k", type=int, default=64)
    parser.add_argument("--check-layers", type=int, default=4, help="layers of the Wan2.1-1.3B correctness model")
    parser.add_argument("--iters", type=int, default=2, help="timed forwards per row (after one warm-up)")
    args = parser.parse_args(argv)
    if not 0.0 < args.sparsity < 1.0:
        parser.error(f"--sparsity must be in (0, 1), got {args.sparsity}")
    if args.check_layers < 1 or args.iters < 1:
        parser.error("--check-layers and --iters must be >= 1")
    device, rank, world = setup(args.tiny)
    dtype = torch.float32 if args.tiny else torch.bfloat16
    try:
        checked = check(args, device, dtype, rank, world)
        rows = timings(args, device, dtype, rank, world)
        if rank == 0:
            meta = run_metadata(device, gpus=world, dtype=str(dtype).split(".")[-1], iters=args.iters, warmup=1,
                                dense_backend="cudnn", parallelism="ulysses")
            text = table(rows, checked)
            write_result(args.out, meta, {"check": checked, "rows": rows}, text)
            print(json.dumps(meta))
            print(text, flush=True)
    finally:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
