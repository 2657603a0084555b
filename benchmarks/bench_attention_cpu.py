"""Block-sparse attention on the CPU: the "gather" backend vs dense ``scaled_dot_product_attention`` and the
"reference" backend, at the built-in demo's attention shape (B=1, H=2, N=M=4,096, D=128, fp32, 128x64 blocks).

Masks: random block masks at a fixed achieved sparsity (every query block keeps the same number of key
blocks) and masks from ``sv.predict_mask`` (hybrid rule, top-p found by bisection to reach the sparsity) on
random q, k with a smooth positional component, so that rows keep different numbers of blocks. For every
mask the gather backend is first checked against the reference backend in float64 (out, lse and the
three gradients); then forward and forward+backward are timed: every round calls each competitor once
(interleaved, so that a load change on a shared machine hits all of them alike), the median over rounds
is reported. Writes its result (the rows and a Markdown table) under --out and prints the table.

    python -m benchmarks attention_cpu
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F

import sparsevid as sv
from .report import write_result
from .run_info import run_metadata
from sparsevid.ops.mask import random_block_mask

SPARSITIES = (0.5, 0.75, 0.9, 0.95)
COMPETITORS = ("sdpa", "gather", "reference")
# Relative error vs float64 allowed for fp32 outputs and gradients (DESIGN.md section 3: "well under 1e-4").
ERROR_BUDGET = 1e-4


def structured_qk(batch: int, heads: int, n: int, d: int, generator: torch.Generator) -> list[torch.Tensor]:
    """q, k float32 [B, H, N, D]: noise plus a component that varies smoothly along the tokens, so that
    pooled attention is peaked near each block's neighbours and predicted masks vary from row to row."""
    smooth = F.avg_pool1d(torch.randn(batch * heads, d, n + 511, generator=generator), 512, stride=1) * 20
    smooth = smooth.transpose(1, 2).reshape(batch, heads, n, d)
    return [smooth + torch.randn(batch, heads, n, d, generator=generator) for _ in range(2)]


def predicted_mask(q: torch.Tensor, k: torch.Tensor, sparsity: float, block_q: int, block_k: int) -> sv.SparseMask:
    """A hybrid-rule mask (top-k of half the target's kept share, top-p by bisection) near ``sparsity``."""
    low, high, best = 0.0, 1.0, None
    for _ in range(14):
        topp = (low + high) / 2
        mask, _ = sv.predict_mask(q, k, rule="hybrid", topk=(1 - sparsity) / 2, topp=topp, block_q=block_q,
                                  block_k=block_k, backend="reference")
        if best is None or abs(mask.sparsity - sparsity) < abs(best.sparsity - sparsity):
            best = mask
        low, high = (topp, high) if mask.sparsity > sparsity else (low, topp)
    return best


def make_masks(args, generator: torch.Generator) -> list[tuple[str, float, sv.SparseMask]]:
    """(kind, target sparsity, mask) for every target and kind."""
    q, k = structured_qk(args.batch, args.heads, args.tokens, args.head_dim, generator)
    masks = []
    for sparsity in args.sparsities:
        masks.append(("random", sparsity, random_block_mask(args.batch, args.heads, args.tokens, args.tokens, sparsity,
                                                            args.block_q, args.block_k, generator=generator)))
        masks.append(("predicted", sparsity, predicted_mask(q, k, sparsity, args.block_q, args.block_k)))
    return masks


def attend(name: str, q, k, v, mask: sv.SparseMask):
    """Competitor ``name``'s attention: dense SDPA, or a block-sparse backend under ``mask``."""
    if name == "sdpa":
        return F.scaled_dot_product_attention(q, k, v)
    return sv.block_sparse_attention(q, k, v, mask, backend=name)


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """||a - ref|| / ||ref|| over the finite entries of ref; inf when a's non-finite entries differ."""
    a, ref = a.detach().double(), ref.detach().double()
    finite = torch.isfinite(ref)
    if not torch.equal(finite, torch.isfinite(a)):
        return float("inf")
    return float((a[finite] - ref[finite]).norm() / ref[finite].norm().clamp_min(1e-300))


def check_error(q, k, v, mask: sv.SparseMask, grad_out: torch.Tensor) -> float:
    """Worst relative error of the gather backend (fp32) vs the reference backend in float64 over out, lse,
    dq, dk and dv."""
    def run(backend, tensors):
        leaves = [t.detach().requires_grad_() for t in tensors]
        out, lse = sv.block_sparse_attention(*leaves, mask, return_lse=True, backend=backend)
        grads = torch.autograd.grad(out, leaves, grad_out.to(out.dtype))
        return [out, lse, *grads]

    expected = run("reference", [t.double() for t in (q, k, v)])
    return max(rel_err(a, r) for a, r in zip(run("gather", (q, k, v)), expected))


def time_interleaved(calls: dict, rounds: int) -> dict[str, float]:
    """Median ms of each ``calls[name]()`` over ``rounds`` rounds that call every one once (after a warm-up)."""
    times = {name: [] for name in calls}
    for fn in calls.values():
        fn()
    for _ in range(rounds):
        for name, fn in calls.items():
            start = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def measure(args, kind: str, target: float, mask: sv.SparseMask, generator: torch.Generator) -> dict:
    """One row: the gather backend's error under ``mask``, then every competitor's fwd and fwd+bwd times."""
    b, h, n, d = args.batch, args.heads, args.tokens, args.head_dim
    q, k, v, grad_out = (torch.randn(b, h, n, d, generator=generator) for _ in range(4))
    error = check_error(q, k, v, mask, grad_out)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]

    def forward(name):
        def call():
            with torch.no_grad():
                attend(name, q, k, v, mask)
        return call

    def forward_backward(name):
        def call():
            torch.autograd.grad(attend(name, *leaves, mask), leaves, grad_out)
        return call

    row = {"kind": kind, "target_sparsity": target, "sparsity": mask.sparsity,
           "kept_blocks_min": int(mask.kv_count.min()), "kept_blocks_max": int(mask.kv_count.max()),
           "gather_error_vs_fp64": error, "passed": error < ERROR_BUDGET}
    for mode, make in (("fwd", forward), ("fwd_bwd", forward_backward)):
        ms = time_interleaved({name: make(name) for name in COMPETITORS}, args.rounds)
        row[mode] = {"ms": ms, "speedup_vs_sdpa": {name: ms["sdpa"] / ms[name] for name in ms}}
    return row


def markdown(result: dict, threads: int) -> str:
    """The rows as a Markdown table under a line naming the shape, threads and the machine's load."""
    lines = [f"CPU block-sparse attention, {result['shape']}, fp32, {threads} threads, "
             f"load average {result['load_before']} before / {result['load_after']} after.",
             "", "| mask | sparsity | kept blocks/row | fwd ms: sdpa / gather / reference | gather vs sdpa | "
             "fwd+bwd ms: sdpa / gather / reference | gather vs sdpa | max rel. err vs fp64 (gather) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        f, fb = r["fwd"], r["fwd_bwd"]
        lines.append(f"| {r['kind']} | {r['sparsity']:.1%} | {r['kept_blocks_min']}-{r['kept_blocks_max']} | "
                     + " / ".join(f"{f['ms'][c]:.1f}" for c in COMPETITORS) + f" | {f['speedup_vs_sdpa']['gather']:.2f}x | "
                     + " / ".join(f"{fb['ms'][c]:.1f}" for c in COMPETITORS)
                     + f" | {fb['speedup_vs_sdpa']['gather']:.2f}x | {r['gather_error_vs_fp64']:.1e} |")
    return "\n".join(lines) + "\n"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True,
                   help="folder of the result (<gpu>.json/.md); python -m benchmarks sets it")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--tokens", type=int, default=4096, help="N = M")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-q", type=int, default=128)
    p.add_argument("--block-k", type=int, default=64)
    p.add_argument("--sparsities", type=float, nargs="+", default=list(SPARSITIES))
    p.add_argument("--rounds", type=int, default=5, help="timed rounds after one warm-up round")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    generator = torch.Generator().manual_seed(args.seed)
    load_before = os.getloadavg()
    rows = []
    for kind, target, mask in make_masks(args, generator):
        rows.append(measure(args, kind, target, mask, generator))
        print(json.dumps(rows[-1]), flush=True)
    meta = run_metadata("cpu", threads=torch.get_num_threads(), rounds=args.rounds)
    result = {"shape": f"B={args.batch} H={args.heads} N=M={args.tokens} D={args.head_dim} "
                       f"blocks {args.block_q}x{args.block_k}",
              "load_before": [round(x, 2) for x in load_before],
              "load_after": [round(x, 2) for x in os.getloadavg()], "rows": rows}
    table = markdown(result, meta["threads"])
    write_result(args.out, meta, result, table)
    print(table)
    failed = [f"{r['kind']} {r['sparsity']:.1%}: {r['gather_error_vs_fp64']:.2e}" for r in rows if not r["passed"]]
    for line in failed:
        print(f"error above {ERROR_BUDGET:g}: {line}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
