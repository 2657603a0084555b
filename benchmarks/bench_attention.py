"""Block-sparse attention benchmark: sparsevid's Triton kernels vs dense SDPA (cuDNN, flash) and FlexAttention.

For every shape, block size and sparsity the same random block mask (diagonal kept) is given to every
sparse competitor. Correctness is checked in the same run before timing (relative error vs a float64
reference on two heads, for out, lse and the three gradients); a Triton error above the bf16 budget of
``ERROR_BUDGET`` (or not finite) is listed at the end and makes the exit status 1. Writes its result under
--out (:func:`benchmarks.report.write_result`: the rows, a Markdown table, the speed-up over cuDNN by sparsity
as a figure) and prints the table.

    python -m benchmarks attention          # also attention_128x64, attention_14b (python -m benchmarks --list)
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import sparsevid as sv
from .report import write_result
from .run_info import run_metadata
from .timing import median_ms
from sparsevid.ops import triton_attention  # kernel internals: TMA variants and the autotuned kernels

SHAPES = {"wan1.3b-480p": (1, 12, 32760, 128), "wan14b-720p": (1, 40, 75600, 128)}
BLOCKS = {"128x128": (128, 128), "128x64": (128, 64)}
# Relative error vs float64 that bf16 kernels may reach (the top of the bf16 range in the design's rules).
ERROR_BUDGET = 1e-2


def attention_flops(n: int, m: int, heads: int, batch: int, d: int, kept: float, backward: bool) -> float:
    """FLOPs of attention over the kept share ``kept`` of an N x M score matrix (backward: 2.5x the forward's)."""
    fwd = 4.0 * batch * heads * n * m * d * kept
    return fwd * 3.5 if backward else fwd


def bench(fn, grad_to_none=None) -> float:
    """Median ms of ``fn()`` on the GPU (:func:`benchmarks.timing.median_ms`, 150 ms of repetitions)."""
    return median_ms(fn, torch.device("cuda"), rep_ms=150, grad_to_none=grad_to_none)


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """||a - ref|| / ||ref|| over the finite entries of ref; inf when a's non-finite entries differ."""
    a, ref = a.double(), ref.double()
    finite = torch.isfinite(ref)
    if not torch.equal(finite, torch.isfinite(a)):
        return float("inf")
    return float((a[finite] - ref[finite]).norm() / ref[finite].norm().clamp_min(1e-30))


def reference_check(mask_full: sv.SparseMask, shape, dtype):
    """Computes the float64 reference on 2 heads of the real sequence length once; returns
    ``errors(backends=("triton",))``, the relative errors of each backend against it (as the backends stand
    when called: the TMA setting may change between calls)."""
    b, _, n, d = shape
    heads = 2
    keep = mask_full.keep[:, :heads]
    mask = sv.SparseMask.from_dense(keep, n, n, mask_full.block_q, mask_full.block_k)
    q, k, v = (torch.randn(b, heads, n, d, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    grad = torch.randn(b, heads, n, d, device="cuda", dtype=dtype)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref_out, ref_lse = sv.block_sparse_attention(q64, k64, v64, mask, return_lse=True, backend="reference")
    ref_grads = torch.autograd.grad(ref_out, (q64, k64, v64), grad.double())

    def errors(backends=("triton",)) -> dict:
        result = {}
        for backend in backends:
            try:
                out, lse = sv.block_sparse_attention(q, k, v, mask, return_lse=True, backend=backend)
                grads = torch.autograd.grad(out, (q, k, v), grad)
            except Exception as exc:  # noqa: BLE001 - a competitor failing to compile is a result, not a crash
                result[backend] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
                continue
            result[backend] = {"out": rel_err(out, ref_out), "lse": rel_err(lse, ref_lse),
                               **{f"d{name}": rel_err(g, r) for name, g, r in zip("qkv", grads, ref_grads)}}
        return result
    return errors


def time_variant(fn, backward: bool, inputs) -> float | str:
    """Median ms of ``fn(q, k, v)`` (forward without autograd, or forward + backward), or the error it raised."""
    q, k, v, grad = inputs
    try:
        if backward:
            def step():
                fn(q, k, v).backward(grad)
            step()
            return bench(step, grad_to_none=[q, k, v])
        with torch.no_grad():  # a forward alone: no autograd graph
            fn(q, k, v)
            return bench(lambda: fn(q, k, v))
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True,
                        help="folder of the result (<gpu>.json/.md/.png); python -m benchmarks sets it")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--blocks", default=",".join(BLOCKS))
    parser.add_argument("--sparsities", default="0,0.5,0.8,0.9,0.95,0.97")
    parser.add_argument("--backward-shapes", default="wan1.3b-480p", help="shapes timed forward+backward too")
    parser.add_argument("--tma", default=os.environ.get("SPARSEVID_TMA", "all"), type=lambda s: s.split("/"),
                        help="'/'-separated SPARSEVID_TMA settings timed side by side on the same masks, e.g. "
                             "'all/none' (each a row; default: the environment's setting)")
    parser.add_argument("--check-sparsities", default="0,0.95",
                        help="sparsities at which errors vs float64 are checked before timing ('' for none)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_attention.py needs a CUDA GPU")
    dtype = torch.bfloat16
    meta = run_metadata("cuda", dtype=str(dtype))
    print(json.dumps(meta), flush=True)
    rows, failed_checks = [], []
    gen = torch.Generator().manual_seed(0)
    for shape_name in args.shapes.split(","):
        b, h, n, d = SHAPES[shape_name]
        with_backward = shape_name in args.backward_shapes.split(",")
        q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
        grad = torch.randn(b, h, n, d, device="cuda", dtype=dtype)
        inputs = (q, k, v, grad)
        dense = {}
        for name, backend in (("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa_flash", SDPBackend.FLASH_ATTENTION)):
            def sdpa(q_, k_, v_, backend=backend):
                with sdpa_kernel(backend):
                    return torch.nn.functional.scaled_dot_product_attention(q_, k_, v_)
            dense[name] = {"fwd": time_variant(sdpa, False, inputs),
                           "fwdbwd": time_variant(sdpa, True, inputs) if with_backward else None}
        print(f"{shape_name} dense: {dense}", flush=True)
        for block_name in args.blocks.split(","):
            block_q, block_k = BLOCKS[block_name]
            for sparsity in (float(s) for s in args.sparsities.split(",")):
                mask = sv.random_block_mask(b, h, n, n, sparsity, block_q, block_k, generator=gen, device="cuda")
                kept = 1.0 - mask.sparsity
                checked = sparsity in [float(s) for s in args.check_sparsities.split(",") if s]
                check = reference_check(mask, (b, h, n, d), dtype) if checked else None

                def attend(q_, k_, v_, backend="triton", mask=mask):
                    return sv.block_sparse_attention(q_, k_, v_, mask, backend=backend)
                flex = {"fwd": time_variant(functools.partial(attend, backend="flex"), False, inputs),
                        "fwdbwd": time_variant(functools.partial(attend, backend="flex"), True, inputs)
                        if with_backward else None}
                for tma in args.tma:
                    triton_attention.TMA = triton_attention.tma_kernels(tma)
                    errors = check() if check is not None else {}
                    failed_checks += [f"{shape_name} {block_name} {sparsity} tma={tma} {name}={err}"
                                      for name, err in errors.get("triton", {}).items()
                                      if not (isinstance(err, float) and err <= ERROR_BUDGET)]
                    reset_autotuning()  # tune for the timed shape (the key has no head count), not the check's
                    times = {"triton": {"fwd": time_variant(attend, False, inputs),
                                        "fwdbwd": time_variant(attend, True, inputs) if with_backward else None},
                             "flex": flex}
                    row = {"shape": shape_name, "B": b, "H": h, "N": n, "D": d, "block": block_name,
                           "tma": tma, "target_sparsity": sparsity, "sparsity": mask.sparsity, "errors": errors}
                    for phase in ("fwd", "fwdbwd"):
                        for name, t in {**{k_: v_[phase] for k_, v_ in dense.items()},
                                        **{k_: v_[phase] for k_, v_ in times.items()}}.items():
                            row[f"{name}_{phase}_ms"] = t
                        tri = times["triton"][phase]
                        if isinstance(tri, float):
                            row[f"triton_{phase}_tflops"] = attention_flops(n, n, h, b, d, kept,
                                                                             phase == "fwdbwd") / tri / 1e9
                            for name in ("sdpa_cudnn", "sdpa_flash"):
                                if isinstance(dense[name][phase], float):
                                    row[f"speedup_vs_{name}_{phase}"] = dense[name][phase] / tri
                            if isinstance(flex[phase], float):
                                row[f"speedup_vs_flex_{phase}"] = flex[phase] / tri
                    row["configs"] = tuned_configs()
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    table = markdown(rows)
    write_result(args.out, meta, {"rows": rows}, table, figure(rows, meta))
    print(table)
    if failed_checks:
        print("errors above the budget:", *failed_checks, sep="\n  ")
        return 1
    return 0


KERNELS = triton_attention.AUTOTUNED_KERNELS


def reset_autotuning() -> None:
    """Forget tuned kernel configs, so each sparsity is timed with the config tuned for it (the autotune
    key holds shapes, not sparsity; in a model the sparsity of a layer is roughly fixed)."""
    for kernel in KERNELS.values():
        kernel.cache.clear()


def tuned_configs() -> dict[str, list[str]]:
    """The configs the autotuner chose for each kernel since the last reset."""
    return {name: [str(config) for config in kernel.cache.values()] for name, kernel in KERNELS.items()}


def figure(rows: list[dict], meta: dict):
    """The speed-up over dense cuDNN SDPA by sparsity, one line per shape, block size, TMA setting and phase."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key in sorted({(r["shape"], r["block"], r["tma"]) for r in rows}):
        for phase, style in (("fwd", "-o"), ("fwdbwd", "--s")):
            pts = sorted((r["sparsity"], r.get(f"speedup_vs_sdpa_cudnn_{phase}")) for r in rows
                         if (r["shape"], r["block"], r["tma"]) == key)
            pts = [(s, v) for s, v in pts if isinstance(v, float)]
            if pts:
                ax.plot(*zip(*pts), style, label=f"{key[0]} {key[1]} {phase} (TMA: {key[2]})")
    ax.set_xlabel("sparsity (fraction of tiles skipped)")
    ax.set_ylabel("speed-up vs dense cuDNN SDPA")
    ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title(f"sparsevid block-sparse attention, {meta['gpu']}, bf16, {meta['commit']}")
    fig.tight_layout()
    return fig


def fmt(value) -> str:
    """A time or ratio to 3 decimals; "fail" for an error message, "-" for not measured."""
    return f"{value:.3f}" if isinstance(value, float) else ("fail" if value else "-")


def markdown(rows: list[dict]) -> str:
    """One table row per measured row: times (ms), speed-ups over cuDNN and FlexAttention, the largest error."""
    lines = ["| shape | block | TMA | sparsity | Triton fwd | Flex fwd | cuDNN fwd | x cuDNN | x Flex | "
             "Triton fwd+bwd | Flex fwd+bwd | x cuDNN | x Flex | max rel. error |", "|---" * 14 + "|"]
    for r in rows:
        errs = [e for e in r["errors"].get("triton", {}).values() if isinstance(e, float)]
        cells = [r["shape"], r["block"], r["tma"], f"{r['sparsity']:.3f}",
                 *(fmt(r.get(key)) for key in ("triton_fwd_ms", "flex_fwd_ms", "sdpa_cudnn_fwd_ms",
                                               "speedup_vs_sdpa_cudnn_fwd", "speedup_vs_flex_fwd",
                                               "triton_fwdbwd_ms", "flex_fwdbwd_ms",
                                               "speedup_vs_sdpa_cudnn_fwdbwd", "speedup_vs_flex_fwdbwd")),
                 f"{max(errs):.2e}" if errs else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return "Times in ms (medians of triton.testing.do_bench).\n\n" + "\n".join(lines)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
