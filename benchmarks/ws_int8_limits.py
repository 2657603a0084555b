"""The warp-specialised int8 forward (``benchmarks/gluon_int8_ws_forward.py``) against the library's Triton int8
forward, on the same quantized inputs and masks: agreement on small odd shapes, then the Wan 1.3B shape at 95% and
with the full mask (and Wan 14B at 95%), dense cuDNN bf16 timed beside them.

    python -m benchmarks ws_int8_limits

Agreement: relative L1 of outputs and the largest lse difference against ``int8_forward`` (the same arithmetic;
the pairs differ only around the sequence's short last block), and relative L1 of both against the float64
reference; a config whose error is above 1.25x the library's against float64 is reported as failing.
"""
from __future__ import annotations

import argparse
import sys

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

import sparsevid as sv
from sparsevid.ops import triton_int8_attention as int8
from sparsevid.ops.reference import reference_block_sparse_attention

from . import gluon_int8_ws_forward as ws
from .int8_kernel_limits import rel_l1
from .report import write_result
from .run_info import run_metadata

# (stages, persistent, consumer registers, producer registers)
VARIANTS = ((3, True, 240, 24), (2, True, 240, 24), (4, True, 240, 24))
SMALL_CASES = (  # (batch, heads, N, M, head dim, block_q, block_k, sparsity or None for the full mask)
    (2, 3, 1000, 700, 128, 128, 64, 0.6), (1, 2, 777, 1500, 64, 128, 64, 0.5), (1, 2, 1024, 1024, 128, 128, 128, 0.5),
    (2, 2, 640, 601, 128, 128, 128, None), (1, 4, 2048, 2048, 128, 128, 64, 0.9),
)


def agreement(gen: torch.Generator) -> list[dict]:
    """Every small case under every variant against the library and float64."""
    rows = []
    for b, h, n, m, d, bq, bk, sparsity in SMALL_CASES:
        q = torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        k, v = (torch.randn(b, h, m, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
        if sparsity is None:
            mask = sv.SparseMask.full(n, m, bq, bk, device="cuda")
        else:
            mask = sv.random_block_mask(b, h, n, m, sparsity, bq, bk, keep_diagonal=False, device="cuda")
            keep = mask.to_dense().clone()
            keep[:, :, 0] = False  # a query block without keys
            mask = sv.SparseMask(keep, n, m, bq, bk)
        scale = d ** -0.5
        qx, x = int8.quantize(q, k, v, bk)
        lib_out, lib_lse = int8.int8_forward(qx, x, mask.kv_count, mask.kv_index, bq, bk, scale, q)
        ref = reference_block_sparse_attention(q.double(), k.double(), v.double(), mask, scale)[0]
        case = {"case": f"B{b} H{h} N{n} M{m} D{d} {bq}x{bk} " + ("full" if sparsity is None else f"{sparsity:.0%}"),
                "library_vs_f64": rel_l1(lib_out, ref)}
        assert ws.supported(qx, x, bq, bk), case
        for stages, persistent, cregs, pregs in VARIANTS:
            out, lse = ws.ws_int8_forward(qx, x, mask.kv_count, mask.kv_index, bq, bk, scale, q, stages, persistent,
                                          cregs, pregs)
            torch.cuda.synchronize()
            finite = torch.isfinite(lib_lse)
            row = {**case, "variant": [stages, persistent, cregs, pregs], "vs_library": rel_l1(out, lib_out),
                   "lse_max_diff": float((lse[finite] - lib_lse[finite]).abs().max()),
                   "lse_inf_match": bool(torch.equal(torch.isinf(lse), torch.isinf(lib_lse))),
                   "vs_f64": rel_l1(out, ref)}
            row["ok"] = (row["vs_f64"] <= 1.25 * row["library_vs_f64"] and row["lse_inf_match"]
                         and row["lse_max_diff"] < 1e-3)
            print(row, flush=True)
            rows.append(row)
    return rows


def timing(gen: torch.Generator, bench) -> list[dict]:
    rows = []
    for name, (b, h, n, d), sparsities in (("wan1.3b", (1, 12, 32760, 128), (0.95, None)),
                                           ("wan14b", (1, 40, 75600, 128), (0.95,))):
        q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            cudnn_ms = bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v))
        qx, x = int8.quantize(q, k, v, 64)
        for sparsity in sparsities:
            mask = (sv.SparseMask.full(n, n, 128, 64, device="cuda") if sparsity is None else
                    sv.predict_mask(q, k, rule="topk", topk=1 - sparsity, block_q=128, block_k=64)[0])
            scale = d ** -0.5
            library = lambda: int8.int8_forward(qx, x, mask.kv_count, mask.kv_index, 128, 64, scale, q)  # noqa: E731
            lib_out = library()[0]
            row = {"shape": name, "mask": "full" if sparsity is None else f"{sparsity:.0%}", "cudnn_ms": cudnn_ms,
                   "library_ms": bench(library),
                   "bf16_ms": bench(lambda: sv.block_sparse_attention(q, k, v, mask, backend="triton"))}
            for stages, persistent, cregs, pregs in VARIANTS:
                run = lambda: ws.ws_int8_forward(qx, x, mask.kv_count, mask.kv_index, 128, 64, scale, q,  # noqa
                                                 stages, persistent, cregs, pregs)
                key = f"ws_s{stages}_{'persistent' if persistent else 'grid'}_{cregs}_{pregs}"
                row[key + "_ms"] = bench(run)
                row[key + "_vs_library"] = rel_l1(run()[0], lib_out)
            row.update({f"x_{key[:-3]}": cudnn_ms / value for key, value in list(row.items())
                        if key.endswith("_ms") and key != "cudnn_ms"})
            print(row, flush=True)
            rows.append(row)
        del q, k, v, qx, x
        torch.cuda.empty_cache()
    return rows


def markdown(result: dict) -> str:
    lines = ["| case | variant | vs library | lse diff | vs float64 (library) | ok |", "|---|---|---|---|---|---|"]
    for r in result["agreement"]:
        lines.append(f"| {r['case']} | {r['variant']} | {r['vs_library']:.2e} | {r['lse_max_diff']:.1e} | "
                     f"{r['vs_f64']:.4f} ({r['library_vs_f64']:.4f}) | {r['ok']} |")
    for r in result["timing"]:
        lines += ["", f"{r['shape']} {r['mask']}: cuDNN {r['cudnn_ms']:.3f} ms"]
        lines += [f"- {key[:-3]}: {value:.3f} ms ({r['cudnn_ms'] / value:.1f}x)" for key, value in r.items()
                  if key.endswith("_ms") and key != "cudnn_ms"]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--skip-timing", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        print("ws_int8_limits needs a Hopper GPU", file=sys.stderr)
        return 2
    gen = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        result = {"agreement": agreement(gen)}
        result["timing"] = [] if args.skip_timing else timing(gen, lambda fn: triton.testing.do_bench(fn, rep=100))
    write_result(args.out, run_metadata("cuda"), result, markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
