"""``sparsevid demo``: block-sparse attention on a small random problem, compared with dense attention."""
from __future__ import annotations

import time

import torch


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("demo", help="run block-sparse attention on a small example and compare to dense")
    parser.add_argument("--tokens", type=int, default=2048, help="sequence length N")
    parser.add_argument("--sparsity", type=float, default=0.9, help="fraction of tiles skipped")
    parser.add_argument("--seed", type=int, default=0)
    parser.set_defaults(func=run)


def run(args) -> int:
    import sparsevid as sv

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(args.seed)
    q, k, v = (torch.randn(1, 4, args.tokens, 128, generator=gen).to(device, dtype) for _ in range(3))
    mask = sv.random_block_mask(1, 4, args.tokens, args.tokens, args.sparsity, generator=gen, device=device)
    start = time.perf_counter()
    out = sv.block_sparse_attention(q, k, v, mask)
    sparse_s = time.perf_counter() - start
    dense = sv.block_sparse_attention(q, k, v, sv.SparseMask.full(args.tokens, args.tokens, device=device))
    print(f"device={device} dtype={dtype} q={tuple(q.shape)} mask={mask}")
    print(f"sparse attention: {sparse_s * 1e3:.1f} ms, output relative L1 vs dense: "
          f"{float((out - dense).abs().sum() / dense.abs().sum()):.3f}")
    return 0
