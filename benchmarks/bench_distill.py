"""Distillation step throughput: Wan2.1-1.3B 480p, dense vs sparse student.

One step is what ``sparsevid.training.distill`` runs per batch (``optimizer_step`` of its training loop): the
dense teacher's velocity (the same transformer with sparse attention off and frozen copies of the trainable
weights, ``DenseTeacher``; no grad), the student's forward and backward (bf16 autocast on CUDA, gradient
checkpointing), gradient clipping and an AdamW update of the trainable weights (``--trainable``). The dense
student runs the same step with dense attention. The transformer is built from the Wan2.1 config with random
fp32 weights (as bench_e2e.py), the clean latents, noise and text states are random, the noise levels
logit-normal with shift 5. Reports the median step time (CUDA-synchronised wall clock), video tokens per second
and peak memory per student; writes its result (rows, Markdown table) under --out.

    python -m benchmarks distill
    # CPU smoke run of the same code path:
    python -m benchmarks --results /tmp/distill distill --device cpu --layers 1 --heads 2 --grid 2x8x8 \
        --text-tokens 16 --warmup 0 --iters 1
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time

import torch

import sparsevid as sv
from .bench_e2e import MODELS, build_transformer, model_config, parse_grid, sync
from .report import write_result
from .run_info import run_metadata
from sparsevid.training import (DenseTeacher, LatentBatch, LoopConfig, noisy, predict_velocity, sample_t,
                                trainable_names)
from sparsevid.training.loop import make_optimizer, optimizer_step


def make_batch(args, grid, device, generator) -> tuple[LatentBatch, torch.Tensor, torch.Tensor]:
    """A batch of random clean latents [B, 16, T, 2H, 2W] and text states [B, L, 4096], its noise levels [B]
    and noise; float32."""
    frames, height, width = grid
    shape = (args.batch, 16, frames, 2 * height, 2 * width)
    latents = torch.randn(shape, generator=generator)
    text = torch.randn(args.batch, args.text_tokens, 4096, generator=generator)
    noise = torch.randn(shape, generator=generator).to(device)
    return LatentBatch(latents, text).to(device), sample_t(args.batch, generator, device, shift=5.0), noise


def distillation_loss(transformer, teacher: DenseTeacher, batch: LatentBatch, t, noise) -> torch.Tensor:
    """The ``"distill"`` objective of ``sparsevid.training.distill``: the student's velocity against the dense
    teacher's at x_t, every forward predicting its own masks."""
    if sv.is_sparse(transformer):
        sv.reset_denoising_step(transformer)
    x_t = noisy(batch.latents, noise, t)
    velocity = predict_velocity(transformer, x_t, t, batch)
    return torch.nn.functional.mse_loss(velocity.float(), teacher(x_t, t, batch).float())


def time_steps(transformer, batches, args, device) -> tuple[list[float], float]:
    """Step times in ms (each on the next batch) and the peak memory in GiB."""
    names = trainable_names(transformer, args.trainable)
    teacher = DenseTeacher(transformer, names)
    wanted = set(names)
    params = [p.requires_grad_(name in wanted) for name, p in transformer.named_parameters()]
    params = [p for p in params if p.requires_grad]
    loop = LoopConfig(max_steps=args.warmup + args.iters)
    optimizer = make_optimizer(params, loop)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()
    times = []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for i in range(args.warmup + args.iters):
        sync(device)
        start = time.perf_counter()
        optimizer_step(lambda _: distillation_loss(transformer, teacher, *batches[i % len(batches)]), i, optimizer,
                       params, loop.lr, loop.grad_clip, autocast)
        sync(device)
        if i >= args.warmup:
            times.append((time.perf_counter() - start) * 1e3)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
    return times, peak


def run(args, device) -> list[dict]:
    """One row per student (``--students``), the speed-up against the dense one where it ran first."""
    spec = MODELS["wan1.3b"]
    config, grid, tokens = model_config("wan1.3b", args)
    generator = torch.Generator().manual_seed(0)
    batches = [make_batch(args, grid, device, generator) for _ in range(2)]
    rows = []
    for label in args.students:
        torch.manual_seed(0)  # the same random weights for every student
        transformer = build_transformer(config, device, torch.float32).train()
        if args.checkpointing:
            transformer.enable_gradient_checkpointing()
        if label == "sparse":
            sv.apply_sparse_attention(transformer, sv.SparseConfig(
                rule=args.rule, topk=args.topk, topp=args.topp, block_q=args.block_q, block_k=args.block_k))
        times, peak = time_steps(transformer, batches, args, device)
        step_ms = statistics.median(times)
        rows.append({"model": spec["label"], "student": label, "tokens": tokens, "grid": list(grid),
                     "layers": config["num_layers"], "heads": config["num_attention_heads"], "batch": args.batch,
                     "trainable": args.trainable, "sparse_config": {"rule": args.rule, "topk": args.topk,
                                                                    "topp": args.topp} if label == "sparse" else None,
                     "gradient_checkpointing": args.checkpointing, "step_ms": step_ms, "step_ms_all": times,
                     "tokens_per_s": args.batch * tokens / step_ms * 1e3, "peak_memory_gib": peak})
        print(f"{label:6s} student: step {step_ms:9.1f} ms, {rows[-1]['tokens_per_s']:10.0f} tokens/s, "
              f"peak {peak:.1f} GiB", flush=True)
        del transformer
        if device.type == "cuda":
            torch.cuda.empty_cache()
    for row in rows:
        row["speedup_vs_dense"] = rows[0]["step_ms"] / row["step_ms"] if rows[0]["student"] == "dense" else None
    return rows


def table(rows) -> str:
    lines = ["| model | student | tokens | batch | step ms | tokens/s | speedup | peak GiB |", "|---" * 8 + "|"]
    for r in rows:
        speedup = "-" if r["speedup_vs_dense"] is None else f"{r['speedup_vs_dense']:.2f}x"
        lines.append(f"| {r['model']} | {r['student']} | {r['tokens']} | {r['batch']} | {r['step_ms']:.1f} | "
                     f"{r['tokens_per_s']:.0f} | {speedup} | {r['peak_memory_gib']:.1f} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True,
                        help="folder of the result (<gpu>.json/.md); python -m benchmarks sets it")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--students", default="dense,sparse", help="comma list of dense, sparse")
    parser.add_argument("--trainable", default="attention", choices=["attention", "all"],
                        help="what the step updates: the self-attention weights (distill's default) or all")
    parser.add_argument("--rule", default="topk", choices=["topk", "topp", "hybrid"],
                        help="top-k (default) holds the sparsity on random weights, whose flat pooled rows make top-p "
                             "keep most tiles")
    parser.add_argument("--topk", type=float, default=0.05)
    parser.add_argument("--topp", type=float, default=0.9)
    parser.add_argument("--block-q", type=int, default=128)
    parser.add_argument("--block-k", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1, help="clips per step")
    parser.add_argument("--text-tokens", type=int, default=512)
    parser.add_argument("--no-checkpointing", dest="checkpointing", action="store_false",
                        help="keep every activation (gradient checkpointing is on by default)")
    parser.add_argument("--layers", type=int, default=0, help="override the number of layers (shrink)")
    parser.add_argument("--heads", type=int, default=0, help="override the number of heads (shrink)")
    parser.add_argument("--grid", type=parse_grid, default=None, help="override the latent grid TxHxW (shrink)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    args = parser.parse_args(argv)
    args.students = args.students.split(",")
    if not args.students or any(s not in ("dense", "sparse") for s in args.students):
        parser.error(f"--students must list dense and/or sparse, got {args.students}")
    if args.batch < 1 or args.iters < 1 or args.warmup < 0:
        parser.error("--batch and --iters must be >= 1, --warmup >= 0")
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    rows = run(args, device)
    meta = run_metadata(device, warmup=args.warmup, iters=args.iters,
                        autocast="bfloat16" if device.type == "cuda" else None)
    text = table(rows)
    write_result(args.out, meta, {"rows": rows}, text)
    print(json.dumps(meta))
    print(text)


if __name__ == "__main__":
    main()
