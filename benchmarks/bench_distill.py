"""Fine-tuning step time and peak memory of a random-weight Wan2.1 transformer (1.3B 480p or 14B 720p), dense
against sparse, through the library's own training step.

Each configuration builds the transformer (bf16 frozen weights, as ``sparsevid distill`` loads it on CUDA), makes it
a student with ``sparsevid.training.prepare_distillation`` (which upcasts the trained tensors to float32 master
weights, adds the LoRA adapter, the dense teacher, gradient checkpointing and ``torch.compile`` as ``distill`` does)
and times ``optimizer_step`` (bf16 autocast, AdamW, gradient clipping) on a two-sample latent folder of random
latents and text states. A configuration is (objective, trainable, checkpointing, compile) and a student:

- "diffusion" (flow matching on the data): the dense student (sparse attention off) against the sparse one, all
  else equal: the speed-up sparse attention brings to a fine-tuning step;
- "distill" (velocity distillation): the sparse student only (a dense student has nothing to distil); each step also
  runs the dense teacher's forward, so its ratio to the dense fine-tuning step is lower.

Reports the median step (CUDA-synchronised wall clock), video tokens per second, peak memory and, for every sparse
row, the speed-up against the dense "diffusion" step of the same trainable / checkpointing / compile setting.

    python -m benchmarks distill
    python -m benchmarks distill_14b
    # CPU smoke run of the same code path:
    python -m benchmarks --results /tmp/distill distill --device cpu --layers 1 --heads 2 --grid 2x8x8 \\
        --text-tokens 16 --warmup 0 --iters 1 --trainable attention --checkpointing on --compile eager
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import statistics
import tempfile
import time

import torch

import sparsevid as sv
from .bench_e2e import MODELS, build_transformer, model_config, parse_grid, sync
from .report import write_result
from .run_info import run_metadata
from sparsevid.training import DistillConfig, LatentDirectory, LoopConfig, ShardWriter, prepare_distillation, write_null_text
from sparsevid.training.loop import make_optimizer, optimizer_step

STUDENTS = {"diffusion": ("dense", "sparse"), "distill": ("sparse",)}


def write_random_latents(directory: str, grid: tuple[int, int, int], text_tokens: int, samples: int = 2) -> None:
    """A latent folder of ``samples`` random Wan latents [16, T, 2H, 2W] with text states [L, 4096]."""
    frames, height, width = grid
    generator = torch.Generator().manual_seed(0)
    with ShardWriter(directory, {"family": "wan"}) as writer:
        for i in range(samples):
            writer.add(torch.randn(16, frames, 2 * height, 2 * width, generator=generator),
                       torch.randn(text_tokens, 4096, generator=generator), metadata={"source": f"random:{i}"})
    write_null_text(directory, torch.zeros(text_tokens, 4096))


def time_configuration(args, config: dict, source, distill_config: DistillConfig, device) -> tuple[list[float], float]:
    """Step times in ms and the peak memory (GiB) of ``args.warmup + args.iters`` steps of one student."""
    torch.manual_seed(0)  # the same random weights for every student
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    transformer = build_transformer(config, device, dtype).train()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    run = prepare_distillation(transformer, source, distill_config, device)
    loop = LoopConfig(max_steps=args.warmup + args.iters)
    optimizer = make_optimizer(run.parameters, loop)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()
    times = []
    for step in range(args.warmup + args.iters):
        sync(device)
        start = time.perf_counter()
        optimizer_step(run.student, run.loss_fn, step, optimizer, run.parameters, loop.lr, loop.grad_clip, autocast)
        sync(device)
        if step >= args.warmup:
            times.append((time.perf_counter() - start) * 1e3)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
    del run, optimizer, transformer
    if device.type == "cuda":
        torch.cuda.empty_cache()
    torch._dynamo.reset()
    return times, peak


def run(args, device, on_row=lambda rows: None) -> list[dict]:
    """One row per (objective, trainable, checkpointing, compile, student); ``on_row(rows)`` after each (a run cut
    short by a time limit keeps the rows it finished)."""
    spec = MODELS[args.model]
    config, grid, tokens = model_config(args.model, args)
    sparse = sv.SparseConfig(rule=args.rule, topk=args.topk, topp=args.topp, block_q=args.block_q,
                             block_k=args.block_k)
    rows = []
    with tempfile.TemporaryDirectory() as data:
        write_random_latents(data, grid, args.text_tokens)
        source = LatentDirectory(data)
        for objective, trainable, checkpointing, compiled in itertools.product(
                args.objectives, args.trainable, args.checkpointing, args.compile):
            for student in STUDENTS[objective]:
                distill_config = DistillConfig(
                    objective=objective, sparse=sparse if student == "sparse" else None, trainable=trainable,
                    batch_size=1, gradient_checkpointing=checkpointing, lora_rank=args.lora_rank,
                    compile=None if compiled == "eager" else compiled)
                times, peak = time_configuration(args, config, source, distill_config, device)
                step_ms = statistics.median(times)
                rows.append({"model": spec["label"], "objective": objective, "trainable": trainable,
                             "gradient_checkpointing": checkpointing, "compile": compiled, "student": student,
                             "tokens": tokens, "grid": list(grid), "layers": config["num_layers"],
                             "heads": config["num_attention_heads"], "batch": 1,
                             "lora_rank": args.lora_rank if trainable == "lora" else None,
                             "sparse_config": sparse.to_dict() if student == "sparse" else None,
                             "step_ms": step_ms, "step_ms_all": times, "tokens_per_s": tokens / step_ms * 1e3,
                             "peak_memory_gib": peak})
                print(f"{objective:9s} {trainable:9s} ckpt={checkpointing!s:5s} {compiled:8s} {student:6s}: step "
                      f"{step_ms:9.1f} ms, peak {peak:6.1f} GiB", flush=True)
                add_speedups(rows)
                on_row(rows)
    return rows


def add_speedups(rows: list[dict]) -> None:
    """Each row's ``speedup_vs_dense_step``: the dense diffusion step of its setting over its step (None until
    that dense step is measured)."""
    dense = {(r["trainable"], r["gradient_checkpointing"], r["compile"]): r["step_ms"] for r in rows
             if r["objective"] == "diffusion" and r["student"] == "dense"}
    for row in rows:
        reference = dense.get((row["trainable"], row["gradient_checkpointing"], row["compile"]))
        row["speedup_vs_dense_step"] = None if reference is None else reference / row["step_ms"]


def table(rows) -> str:
    lines = ["| model | objective | trainable | checkpointing | compile | student | step ms | tokens/s | "
             "vs dense step | peak GiB |", "|---" * 10 + "|"]
    for r in rows:
        speedup = "-" if r["speedup_vs_dense_step"] is None else f"{r['speedup_vs_dense_step']:.2f}x"
        lines.append(f"| {r['model']} | {r['objective']} | {r['trainable']} | "
                     f"{'on' if r['gradient_checkpointing'] else 'off'} | {r['compile']} | {r['student']} | "
                     f"{r['step_ms']:.1f} | {r['tokens_per_s']:.0f} | {speedup} | {r['peak_memory_gib']:.1f} |")
    return "\n".join(lines)


def _choices(allowed: tuple[str, ...], parse=str):
    def parse_list(text: str) -> list:
        items = text.split(",")
        if not items or any(item not in allowed for item in items):
            raise argparse.ArgumentTypeError(f"expected a comma list of {allowed}, got {text!r}")
        return [parse(item) for item in items]
    return parse_list


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True,
                        help="folder of the result (<gpu>.json/.md); python -m benchmarks sets it")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--model", choices=sorted(MODELS), default="wan1.3b")
    parser.add_argument("--objectives", type=_choices(tuple(STUDENTS)), default=["diffusion", "distill"],
                        help="comma list of diffusion (dense and sparse students) and distill (sparse student)")
    parser.add_argument("--trainable", type=_choices(("attention", "lora", "all")), default=["attention", "lora"],
                        help="comma list: the self-attention weights, a LoRA adapter on them, or every weight")
    parser.add_argument("--checkpointing", type=_choices(("on", "off"), lambda s: s == "on"), default=[True, False],
                        help="comma list of on, off (gradient checkpointing)")
    parser.add_argument("--compile", type=_choices(("eager", "inductor")), default=["eager"],
                        help="comma list of eager, inductor (compile_repeated_blocks)")
    parser.add_argument("--lora-rank", type=int, default=64)
    parser.add_argument("--rule", default="topk", choices=["topk", "topp", "hybrid"],
                        help="top-k (default) holds the sparsity on random weights, whose flat pooled rows make top-p "
                             "keep most tiles")
    parser.add_argument("--topk", type=float, default=0.05)
    parser.add_argument("--topp", type=float, default=0.9)
    parser.add_argument("--block-q", type=int, default=128)
    parser.add_argument("--block-k", type=int, default=64)
    parser.add_argument("--text-tokens", type=int, default=512)
    parser.add_argument("--layers", type=int, default=0, help="override the number of layers (shrink)")
    parser.add_argument("--heads", type=int, default=0, help="override the number of heads (shrink)")
    parser.add_argument("--grid", type=parse_grid, default=None, help="override the latent grid TxHxW (shrink)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--iters", type=int, default=3)
    args = parser.parse_args(argv)
    if args.iters < 1 or args.warmup < 0:
        parser.error("--iters must be >= 1, --warmup >= 0")
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    meta = run_metadata(device, warmup=args.warmup, iters=args.iters,
                        autocast="bfloat16" if device.type == "cuda" else None)
    rows = run(args, device, lambda done: write_result(args.out, meta, {"rows": done}, table(done)))
    print(json.dumps(meta))
    print(table(rows))


if __name__ == "__main__":
    main()
