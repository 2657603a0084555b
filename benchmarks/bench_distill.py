"""Distillation step throughput: Wan2.1-1.3B 480p, dense teacher, dense vs sparse student.

One step is what ``sparsevid distill`` runs per batch: the frozen teacher's forward (bf16 weights, no grad), the
student's forward and backward (fp32 weights, bf16 autocast, gradient checkpointing), gradient clipping and
an AdamW update. The transformers are built from the Wan2.1 config with random weights (as in
bench_e2e.py), the clean latents, noise and text states are random, the noise levels logit-normal with
shift 5. Reports the median step time (CUDA-synchronised wall clock), video tokens per second and peak
memory per student; writes results.json and table.md under --out.

    python3 -m benchmarks.bench_distill --out results/distill
    # CPU smoke run of the same code path:
    python3 -m benchmarks.bench_distill --out /tmp/distill --device cpu --layers 1 --heads 2 --grid 2x8x8 \
        --text-tokens 16 --warmup 0 --iters 1
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from pathlib import Path

import torch

import sparsevid as sv
from .bench_e2e import MODELS, build_transformer, model_config, parse_grid, sync
from .run_info import run_metadata
from sparsevid.training import distillation_loss, sample_t


class Velocity(torch.nn.Module):
    """A Wan transformer as ``model(x_t, t, text_states) -> velocity`` with t in [0, 1] (timestep 1000 t)."""

    def __init__(self, transformer):
        super().__init__()
        self.transformer = transformer

    def forward(self, x, t, text_states):
        return self.transformer(x, t * 1000.0, text_states, return_dict=False)[0]


def make_batch(args, grid, device, generator):
    """Clean latents and noise [B, 16, T, 2H, 2W], noise levels [B], text states [B, L, 4096]; float32 (the
    step runs under bf16 autocast on CUDA)."""
    frames, height, width = grid
    shape = (args.batch, 16, frames, 2 * height, 2 * width)
    x0 = torch.randn(shape, generator=generator).to(device)
    noise = torch.randn(shape, generator=generator).to(device)
    t = sample_t(args.batch, generator, device, shift=5.0)
    text = torch.randn(args.batch, args.text_tokens, 4096, generator=generator).to(device)
    return x0, text, t, noise


def time_steps(student, teacher, optimizer, batches, args, device) -> tuple[list[float], float]:
    """Step times in ms (each on the next batch) and the peak memory in GiB."""
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda"
                else contextlib.nullcontext())
    params = [p for p in student.parameters() if p.requires_grad]
    times = []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for i in range(args.warmup + args.iters):
        sync(device)
        start = time.perf_counter()
        if sv.is_sparse(student.transformer):
            sv.reset_denoising_step(student.transformer)  # as the trainer: every forward predicts its masks
        with autocast:
            loss = distillation_loss(student, teacher, *batches[i % len(batches)])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        sync(device)
        if i >= args.warmup:
            times.append((time.perf_counter() - start) * 1e3)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
    return times, peak


def run(args, device) -> list[dict]:
    spec = MODELS["wan1.3b"]
    config, grid, tokens = model_config("wan1.3b", args)
    torch.manual_seed(0)
    teacher = Velocity(build_transformer(config, device, torch.bfloat16 if device.type == "cuda" else torch.float32))
    generator = torch.Generator().manual_seed(0)
    batches = [make_batch(args, grid, device, generator) for _ in range(2)]
    rows = []
    for label in args.students:
        torch.manual_seed(0)  # the same random weights as the teacher, in fp32
        student = Velocity(build_transformer(config, device, torch.float32)).train().requires_grad_(True)
        if args.checkpointing:
            student.transformer.enable_gradient_checkpointing()
        if label == "sparse":
            sv.apply_sparse_attention(student.transformer, sv.SparseConfig(
                rule=args.rule, topk=args.topk, topp=args.topp, block_q=args.block_q, block_k=args.block_k))
        optimizer = torch.optim.AdamW(student.parameters(), lr=1e-5, fused=device.type == "cuda")
        times, peak = time_steps(student, teacher, optimizer, batches, args, device)
        step_ms = statistics.median(times)
        rows.append({"model": spec["label"], "student": label, "tokens": tokens, "grid": list(grid),
                     "layers": config["num_layers"], "heads": config["num_attention_heads"], "batch": args.batch,
                     "sparse_config": {"rule": args.rule, "topk": args.topk, "topp": args.topp}
                     if label == "sparse" else None, "gradient_checkpointing": args.checkpointing,
                     "step_ms": step_ms, "step_ms_all": times, "tokens_per_s": args.batch * tokens / step_ms * 1e3,
                     "peak_memory_gib": peak})
        print(f"{label:6s} student: step {step_ms:9.1f} ms, {rows[-1]['tokens_per_s']:10.0f} tokens/s, "
              f"peak {peak:.1f} GiB", flush=True)
        del student, optimizer
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
    parser.add_argument("--out", required=True, type=Path, help="output directory (results.json, table.md)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--students", default="dense,sparse", help="comma list of dense, sparse")
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
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    text = table(rows)
    (args.out / "table.md").write_text(text + "\n")
    print(json.dumps(meta))
    print(text)


if __name__ == "__main__":
    main()
