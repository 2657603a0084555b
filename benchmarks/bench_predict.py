"""Mask-prediction benchmark: fused ``predict_mask`` (Triton) vs a naive PyTorch version, and attention
recall of predicted masks for raster vs 3D-tiled token order.

1. For each shape (Wan 1.3B: H=12, N=32760; Wan 14B: H=40, N=75600; D=128, block 128x64) the fused masks
   are first checked against the PyTorch path of ``predict_mask`` (and the naive version), then both are
   timed (``triton.testing.do_bench`` medians over several input sets): pool + score + select + index table,
   next to the block-sparse attention forward at 95% sparsity (random mask) for the cost ratio.
2. Recall: on a video-like field (below) on a Wan-like grid (21x30x52), masks at ~95% sparsity (top-k 5%)
   are predicted in raster order and in several 3D-tile orders, and the exact attention recall (true
   softmax mass kept) of each is measured.

Video-like field: for a token at (t, y, x), q and k are ``amp * phi(t / l_t, y / l_s, x / l_s)`` plus
Gaussian noise of std ``noise`` (amp = 12, noise = 0.5), where ``phi`` are D random Fourier features
``sqrt(2/D) cos(W p + b)`` (W ~ N(0, 1), b ~ U(0, 2 pi)), so ``q_i . k_j`` approximates
``amp^2 exp(-|p_i - p_j|^2 / 2)``: attention concentrates on nearby positions in space and time, as in video DiTs. Each head draws its own length
scales l_t in [1, 4] frames and l_s in [2, 8] tokens.

Writes results.json under --out and prints a short table last.

    python3 benchmarks/bench_predict.py --out results/predict
    python3 benchmarks/bench_predict.py --out /tmp/p --shapes tiny --recall-grid 6,12,16   # CPU, slow
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the Triton kernels run on the CPU through the interpreter

import triton  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import sparsevid as sv  # noqa: E402
from sparsevid.eval import attention_recall  # noqa: E402
from sparsevid.ops.mask import kept_index_table  # noqa: E402
from sparsevid.ops.tiling import tile_tokens  # noqa: E402
from run_info import git_commit  # noqa: E402  (benchmarks/ is on sys.path when run as a script)

# name: (B, H, N, D, (T, H, W) grid of the tokens)
SHAPES = {
    "wan1.3b": (1, 12, 32760, 128, (21, 30, 52)),
    "wan14b": (1, 40, 75600, 128, (21, 45, 80)),
    "tiny": (1, 2, 2048, 64, (8, 16, 16)),
}
TILES = {"2x8x8": (2, 8, 8), "4x4x8": (4, 4, 8), "1x8x16": (1, 8, 16), "2x4x16": (2, 4, 16)}
RULE = dict(rule="hybrid", topk=0.05, topp=0.9, block_q=128, block_k=64)
MAX_DIFFERING_ROWS = 1e-3


def video_field(grid, heads: int, d: int, batch: int = 1, amp: float = 12.0, noise: float = 0.5,
                device="cpu", dtype=torch.float32, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [B, H, T*H*W, D] in raster order (module docstring), transposed views of [B, L, H, D]."""
    gen = torch.Generator(device=device).manual_seed(seed)
    t, h, w = grid
    pos = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij"), -1)
    pos = pos.reshape(-1, 3).float().to(device)
    out = []
    for _ in range(2):
        per_head = []
        for head in range(heads):
            hg = torch.Generator(device="cpu").manual_seed(seed * 1000 + head)
            lt, ls = 1 + 3 * torch.rand(1, generator=hg).item(), 2 + 6 * torch.rand(1, generator=hg).item()
            freq = (torch.randn(3, d, generator=hg) / torch.tensor([[lt], [ls], [ls]])).to(device)
            phase = (2 * math.pi * torch.rand(d, generator=hg)).to(device)
            feats = amp * math.sqrt(2.0 / d) * torch.cos(pos @ freq + phase)
            per_head.append(feats + noise * torch.randn(batch, pos.shape[0], d, generator=gen, device=device))
        out.append(torch.stack(per_head, dim=2).to(dtype).transpose(1, 2))  # [B, L, H, D] viewed as [B, H, L, D]
    return out[0], out[1]


def naive_predict(q, k, topk: float, topp: float, block_q: int, block_k: int):
    """Baseline: pool (pad + mean), softmax, full sort, cumsum, threshold, index table by sort."""
    b, h, n, d = q.shape

    def pool(x, block):
        length = x.shape[2]
        nb = -(-length // block)
        padded = torch.nn.functional.pad(x.float(), (0, 0, 0, nb * block - length))
        counts = torch.full((nb,), float(block), device=x.device)
        counts[-1] = length - (nb - 1) * block
        return padded.view(b, h, nb, block, d).sum(3) / counts[:, None]

    scores = torch.softmax(pool(q, block_q) @ pool(k, block_k).mT * d ** -0.5, dim=-1)
    ordered, _ = torch.sort(scores, dim=-1, descending=True)
    kb = scores.shape[-1]
    count = min(kb, max(1, math.ceil(topk * kb - 1e-6)))
    tau_k = ordered[..., count - 1: count]
    first = (ordered.cumsum(-1) < topp).sum(-1, keepdim=True).clamp_max(kb - 1)
    tau_p = ordered.gather(-1, first)
    keep = scores >= torch.minimum(tau_k, tau_p)
    return keep, kept_index_table(keep)


def timer(device):
    if device.type == "cuda":
        return lambda fn: triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")

    def cpu_median(fn, reps: int = 3) -> float:
        fn()
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)

    return cpu_median


def differing_rows(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a != b).any(dim=-1).double().mean())


def bench_shape(name: str, device, dtype, input_sets: int) -> dict:
    b, h, n, d, grid = SHAPES[name]
    measure = timer(device)
    fused_ms, naive_ms, checks = [], [], []
    for seed in range(input_sets):
        q, k = video_field(grid, h, d, b, device=device, dtype=dtype, seed=seed)
        mask, stats = sv.predict_mask(q, k, backend="triton", **RULE)
        ref, _ = sv.predict_mask(q, k, backend="torch", **RULE)
        naive_keep, (naive_count, naive_index) = naive_predict(q, k, RULE["topk"], RULE["topp"], RULE["block_q"],
                                                               RULE["block_k"])
        count, index = kept_index_table(mask.keep)
        check = {"differing_rows_vs_torch": differing_rows(mask.keep, ref.keep),
                 "differing_rows_vs_naive": differing_rows(mask.keep, naive_keep),
                 "tables_match_keep": bool(torch.equal(count, mask.kv_count) and torch.equal(index, mask.kv_index)),
                 "sparsity": stats.sparsity}
        if not (check["tables_match_keep"] and check["differing_rows_vs_torch"] <= MAX_DIFFERING_ROWS
                and check["differing_rows_vs_naive"] <= MAX_DIFFERING_ROWS):
            raise SystemExit(f"{name}: fused masks disagree with the PyTorch path: {check}")
        checks.append(check)
        fused_ms.append(measure(lambda: sv.predict_mask(q, k, backend="triton", **RULE)))
        if seed == 0:
            v = torch.randn_like(q)
            sparse = sv.random_block_mask(b, h, n, n, 0.95, RULE["block_q"], RULE["block_k"], device=device)
            attention_ms = measure(lambda: sv.block_sparse_attention(q, k, v, sparse))
            del v
        naive_ms.append(measure(lambda: naive_predict(q, k, RULE["topk"], RULE["topp"], RULE["block_q"],
                                                      RULE["block_k"])))
        del q, k, mask, ref, naive_keep, naive_count, naive_index
    fused, naive = statistics.median(fused_ms), statistics.median(naive_ms)
    read_bytes = 2 * b * h * n * d * torch.finfo(dtype).bits // 8
    return {"shape": name, "B": b, "H": h, "N": n, "D": d, **RULE, "dtype": str(dtype).removeprefix("torch."),
            "fused_ms": fused, "naive_ms": naive, "speedup_vs_naive": naive / fused,
            "attention_95_ms": attention_ms, "fused_over_attention": fused / attention_ms,
            "fused_read_TBps": read_bytes / (fused * 1e-3) / 1e12, "checks": checks}


def recall_study(grid, heads: int, d: int, device, dtype, tiles: list[str]) -> list[dict]:
    q, k = video_field(grid, heads, d, device=device, dtype=dtype, seed=123)
    rows = []
    for order in ["raster", *tiles]:
        qo, ko = (q, k) if order == "raster" else (tile_tokens(t, grid, TILES[order]) for t in (q, k))
        mask, stats = sv.predict_mask(qo, ko, rule="topk", topk=0.05, block_q=128, block_k=64)
        recall = attention_recall(qo, ko, mask)
        rows.append({"order": order, "sparsity": stats.sparsity, "recall": float(recall.mean()),
                     "recall_per_head": [round(float(r), 4) for r in recall.mean(0)]})
    return rows


def main() -> None:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="directory for results.json")
    parser.add_argument("--shapes", default="wan1.3b,wan14b" if cuda else "tiny",
                        help=f"comma list of {sorted(SHAPES)}")
    parser.add_argument("--input-sets", type=int, default=3 if cuda else 1, help="random input sets per shape")
    parser.add_argument("--recall-grid", default="21,30,52" if cuda else "6,12,16", help="T,H,W token grid")
    parser.add_argument("--recall-heads", type=int, default=4 if cuda else 2)
    parser.add_argument("--tiles", default=",".join(TILES), help=f"comma list of {list(TILES)}")
    args = parser.parse_args()

    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32  # the interpreter's dots need fp16/fp32
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    timing = [bench_shape(name, device, dtype, args.input_sets) for name in args.shapes.split(",") if name]
    grid = tuple(int(v) for v in args.recall_grid.split(","))
    recall = recall_study(grid, args.recall_heads, 128, device, dtype, [t for t in args.tiles.split(",") if t])
    result = {
        "device": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
        "torch": torch.__version__, "triton": triton.__version__, "commit": git_commit(),
        "timing": timing, "recall": {"grid": grid, "heads": args.recall_heads, "rule": "topk 5%",
                                     "orders": recall},
    }
    (out_dir / "results.json").write_text(json.dumps(result, indent=2))

    print(f"\n{result['device']}  torch {result['torch']}  triton {result['triton']}  commit {result['commit']}")
    print(f"{'shape':<10}{'H':>4}{'N':>8}{'fused ms':>10}{'naive ms':>10}{'speedup':>9}{'TB/s':>7}"
          f"{'attn95 ms':>11}{'fused/attn':>11}")
    for row in timing:
        print(f"{row['shape']:<10}{row['H']:>4}{row['N']:>8}{row['fused_ms']:>10.4f}{row['naive_ms']:>10.4f}"
              f"{row['speedup_vs_naive']:>8.1f}x{row['fused_read_TBps']:>7.2f}{row['attention_95_ms']:>11.4f}"
              f"{row['fused_over_attention']:>11.3f}")
    print(f"\nrecall at top-k 5% on grid {grid}:")
    for row in recall:
        print(f"  {row['order']:<8} sparsity {row['sparsity']:.3f}  recall {row['recall']:.4f}")


if __name__ == "__main__":
    main()
