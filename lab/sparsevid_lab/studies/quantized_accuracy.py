"""Accuracy of the quantized forwards (precision "fp8" and "int8", their PyTorch emulations on the CPU) against
float64 block-sparse attention on the same mask, on three kinds of q, k, v: recorded from the built-in model's
self-attentions (the first sampling step, the CPU clip), video-like with outlier channels
(``benchmarks.bench_attention_fp8.video_like_inputs``) and Gaussian noise. Cosine similarity and relative L1 error
per output, as the GPU benchmark reports them against the bf16 kernel.

    python -m sparsevid_lab.studies.quantized_accuracy --out OUT
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import sparsevid as sv
from benchmarks.bench_attention_fp8 import output_metrics, video_like_inputs
from benchmarks.run_info import run_metadata

PRECISIONS = ("fp8", "int8")


def recorded_attention_inputs(layers: int = 3) -> list[tuple[torch.Tensor, ...]]:
    """q, k, v [1, H, N, D] (bf16) of the first ``layers`` self-attentions of the built-in model at its CPU clip,
    at the first sampling step (noise, t = 1, null caption)."""
    from sparsevid_lab.model.builtin import load_builtin

    model = load_builtin()
    model.use_cpu_defaults()
    c, t, hgt, wid = model.clip_shape
    recorded = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def record(*args, **kwargs):
        q, k, v = (kwargs[name] if name in kwargs else args[i] for i, name in enumerate(("query", "key", "value")))
        if q.shape[-2] == k.shape[-2] and len(recorded) < layers:  # self-attention (cross-attention reads text)
            recorded.append(tuple(x.detach().bfloat16() for x in (q, k, v)))
        return sdpa(*args, **kwargs)

    torch.nn.functional.scaled_dot_product_attention = record
    try:
        with torch.no_grad():
            model(torch.randn(1, c, t, hgt, wid, generator=torch.Generator().manual_seed(0)), torch.ones(1),
                  model.tokenize([""]))
    finally:
        torch.nn.functional.scaled_dot_product_attention = sdpa
    return recorded


def measure(q, k, v, sparsity: float) -> dict:
    """Each precision's metrics against float64 attention on one random 128x64 mask (diagonal kept)."""
    b, h, n, _ = q.shape
    mask = sv.random_block_mask(b, h, n, k.shape[2], sparsity, 128, 64)
    ref = sv.block_sparse_attention(q.double(), k.double(), v.double(), mask, backend="reference")
    return {p: output_metrics(sv.block_sparse_attention(q, k, v, mask, precision=p, backend="reference"), ref)
            for p in PRECISIONS}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.manual_seed(0)
    cases = [(f"built-in layer {i}", qkv) for i, qkv in enumerate(recorded_attention_inputs())]
    for n, d in ((2048, 128), (2048, 64)):
        cases.append((f"video-like N={n} D={d}", video_like_inputs(1, 2, n, n, d, outlier=True, device="cpu")))
        cases.append((f"Gaussian N={n} D={d}", tuple(torch.randn(1, 2, n, d).bfloat16() for _ in range(3))))
    rows = []
    for name, (q, k, v) in cases:
        for sparsity in (0.5, 0.9):
            rows.append({"inputs": name, "shape": list(q.shape), "sparsity": sparsity,
                         **measure(q, k, v, sparsity)})
            print(json.dumps(rows[-1]), flush=True)
    lines = ["| inputs | sparsity | fp8 (two-term Q): cosine / rel L1 | int8 Q K^T: cosine / rel L1 |",
             "|---|---|---|---|"]
    lines += [f"| {r['inputs']} | {r['sparsity']} | " + " | ".join(
        f"{r[p]['cosine']:.5f} / {r[p]['rel_l1']:.4f}" for p in PRECISIONS) + " |" for r in rows]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "quantized_accuracy.json").write_text(json.dumps({"meta": run_metadata("cpu"), "rows": rows},
                                                                 indent=1) + "\n")
    (args.out / "quantized_accuracy.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
