"""The quantized block-sparse forwards (precision "fp8" and "int8") vs the bf16 (native) kernel on the same masks,
and dense cuDNN SDPA.

For every shape and sparsity one 128x64 block mask serves every sparse competitor: the mask ``predict_mask``
(top-k, keep fraction 1 - sparsity) predicts from the timed inputs, or the full mask. Times (medians of
``triton.testing.do_bench``): for each quantized precision the public call (quantization included), its
quantization alone and its kernel alone on quantized inputs; prediction + the int8 call and prediction + the bf16
call through the public API; the bf16 sparse kernel; dense cuDNN SDPA. Accuracy of each quantized output against
the bf16 sparse kernel's (cosine similarity, relative L1), on the timed inputs (Gaussian) and on video-like inputs
(:func:`video_like_inputs`). Writes JSON, a Markdown table and the speed-up figure under --out
(:func:`benchmarks.report.write_result`, after every row) and prints the table.

    python -m benchmarks attention_fp8
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import sparsevid as sv
from sparsevid.ops import triton_fp8_attention, triton_int8_attention
from .bench_attention import SHAPES, attention_flops, bench, fmt
from .bench_predict import host_us
from .report import write_result
from .run_info import run_metadata
from .timing import cuda_kernel_ms

# The accuracy targets against the bf16 sparse kernel (video-like inputs).
TARGET_COSINE, TARGET_REL_L1 = 0.999, 0.03
QUANTIZED = ("fp8", "int8")


def video_like_inputs(b, h, n, m, d, outlier: bool = False, generator=None, device="cuda"):
    """q [B, H, N, D], k, v [B, H, M, D] in bf16 on ``device``, made like a video DiT's: a smooth latent sequence
    (64 channels, a running mean over 9 tokens) through random projections, plus noise; with ``outlier`` a large
    token-shared offset on three K channels and one V channel 30x wider."""
    def latent(t):
        x = torch.randn(b * 64, 1, t + 8, device=device, generator=generator)
        return torch.nn.functional.avg_pool1d(x, 9, 1).view(b, 1, 64, t).transpose(-1, -2) * 3
    xq, xkv = latent(n), latent(m)
    w = [torch.randn(64, d, device=device, generator=generator) / 8 for _ in range(3)]
    noise = [torch.randn(b, h, t, d, device=device, generator=generator) * 0.3 for t in (n, m, m)]
    q, k, v = xq @ w[0] + noise[0], xkv @ w[1] + noise[1], xkv @ w[2] + noise[2]
    if outlier:
        k[..., :3] += 20.0
        v[..., 5] *= 30.0
    return q.bfloat16(), k.bfloat16(), v.bfloat16()


def output_metrics(out: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """Cosine similarity and relative L1 error of out against ref, over all elements."""
    out, ref = out.double().flatten(), ref.double().flatten()
    return {"cosine": float(torch.nn.functional.cosine_similarity(out, ref, dim=0)),
            "rel_l1": float((out - ref).abs().sum() / ref.abs().sum())}


def accuracy(q, k, v, mask) -> dict[str, dict[str, float]]:
    """Each quantized precision against the bf16 sparse kernel on the same inputs and mask."""
    native = sv.block_sparse_attention(q, k, v, mask, backend="triton")
    return {p: output_metrics(sv.block_sparse_attention(q, k, v, mask, precision=p), native) for p in QUANTIZED}


def bench_mask(q, k, sparsity: float, block_q: int, block_k: int):
    """(mask, predict): the mask every competitor runs with at ``sparsity`` (the full mask at 0) and the
    prediction that gives it (None at 0)."""
    n, m = q.shape[2], k.shape[2]
    if sparsity == 0:
        return sv.SparseMask.full(n, m, block_q, block_k, device=q.device), None
    options = dict(rule="topk", topk=1.0 - sparsity, block_q=block_q, block_k=block_k)
    return sv.predict_mask(q, k, **options)[0], (lambda: sv.predict_mask(q, k, **options)[0])


def quantizer_costs(q, k, v, block_q: int, block_k: int) -> dict:
    """Each quantizer's do_bench time (ms), host time per call (us) and device time per kernel (us): whether it is
    bound by its launches or by one of its kernels."""
    calls = {"fp8": lambda: triton_fp8_attention.quantize(q, k, v, block_q, block_k),
             "int8": lambda: triton_int8_attention.quantize(q, k, v, block_k)}
    costs = {}
    for name, fn in calls.items():
        costs[f"{name}_quant_ms"] = bench(fn)
        costs[f"{name}_quant_host_us"] = host_us(fn)
        costs[f"{name}_quant_kernels_us"] = {kernel: ms * 1e3 for kernel, ms in cuda_kernel_ms(fn).items()}
    return costs


def time_row(q, k, v, mask, predict, block_q: int, block_k: int) -> dict[str, float]:
    """Every timing of one mask (ms)."""
    d = q.shape[-1]
    x8 = triton_fp8_attention.quantize(q, k, v, block_q, block_k)
    qi, xi = triton_int8_attention.quantize(q, k, v, block_k)
    times = {
        "bf16_ms": bench(lambda: sv.block_sparse_attention(q, k, v, mask, backend="triton")),
        "fp8_ms": bench(lambda: sv.block_sparse_attention(q, k, v, mask, precision="fp8")),
        "fp8_kernel_ms": bench(lambda: triton_fp8_attention.fp8_forward(
            x8, mask.kv_count, mask.kv_index, block_q, block_k, d ** -0.5, q)),
        "int8_ms": bench(lambda: sv.block_sparse_attention(q, k, v, mask, precision="int8")),
        "int8_kernel_ms": bench(lambda: triton_int8_attention.int8_forward(
            qi, xi, mask.kv_count, mask.kv_index, block_q, block_k, d ** -0.5, q)),
    }
    if predict is not None:
        times["predict_ms"] = bench(predict)
        times["predict_int8_ms"] = bench(lambda: sv.block_sparse_attention(q, k, v, predict(), precision="int8"))
        times["predict_bf16_ms"] = bench(lambda: sv.block_sparse_attention(q, k, v, predict(), backend="triton"))
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder of the result (<gpu>.json/.md/.png)")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--sparsities", default="0.95,0.9,0.5,0/0.95",
                        help="per shape (in --shapes order, '/'-separated; the last serves the rest)")
    parser.add_argument("--block", default="128x64", help="block_q x block_k of the mask")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_attention_fp8.py needs a CUDA GPU")
    block_q, block_k = (int(s) for s in args.block.split("x"))
    meta = run_metadata("cuda", dtype="bfloat16 inputs; fp8: e4m3 products; int8: int8 QK^T, e4m3 PV",
                        block=args.block)
    print(json.dumps(meta), flush=True)
    rows, missed = [], []
    gen = torch.Generator(device="cuda").manual_seed(0)
    shapes = args.shapes.split(",")
    per_shape = args.sparsities.split("/")
    warnings.filterwarnings("ignore", message=".*keeps every tile.*")
    for i, shape_name in enumerate(shapes):
        b, h, n, d = SHAPES[shape_name]
        q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
        video = video_like_inputs(b, h, n, n, d, outlier=True, generator=gen)
        with torch.no_grad(), sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            cudnn_ms = bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v))
        with torch.no_grad():
            quant = quantizer_costs(q, k, v, block_q, block_k)
            print(json.dumps({"shape": shape_name, **quant}), flush=True)
        for sparsity in (float(s) for s in per_shape[min(i, len(per_shape) - 1)].split(",")):
            with torch.no_grad():
                mask, predict = bench_mask(q, k, sparsity, block_q, block_k)
                times = time_row(q, k, v, mask, predict, block_q, block_k)
                acc = {"gaussian": accuracy(q, k, v, mask), "video_like": accuracy(*video, mask)}
            flops = attention_flops(n, n, h, b, d, 1.0 - mask.sparsity, backward=False)
            row = {"shape": shape_name, "B": b, "H": h, "N": n, "D": d, "block": args.block,
                   "target_sparsity": sparsity, "sparsity": mask.sparsity, "sdpa_cudnn_ms": cudnn_ms, **quant,
                   **times, "bf16_tflops": flops / times["bf16_ms"] / 1e9,
                   **{f"{p}_kernel_tflops": flops / times[f"{p}_kernel_ms"] / 1e9 for p in QUANTIZED},
                   **{f"speedup_{name[:-3]}_vs_cudnn": cudnn_ms / times[name] for name in times
                      if name != "predict_ms"},
                   "fp8_config": str(triton_fp8_attention._bsa_fp8_fwd_kernel.best_config),
                   "int8_config": str(triton_int8_attention._bsa_int8_fwd_kernel.best_config),
                   "accuracy_vs_bf16": acc}
            rows.append(row)
            print(json.dumps(row), flush=True)
            write_result(args.out, meta, {"rows": rows}, markdown(rows), figure(rows, meta))
            video_acc = acc["video_like"]["int8"]
            if not (video_acc["cosine"] >= TARGET_COSINE and video_acc["rel_l1"] <= TARGET_REL_L1):
                missed.append(f"{shape_name} {sparsity}: {video_acc}")
    print(markdown(rows))
    if missed:
        print("video-like accuracy of int8 below the targets:", *missed, sep="\n  ")
        return 1
    return 0


def figure(rows: list[dict], meta: dict):
    """Speed-up over dense cuDNN SDPA by sparsity: each precision's public call (quantization included), one line
    per shape and precision."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for shape in sorted({r["shape"] for r in rows}):
        for key, style, label in (("speedup_int8_vs_cudnn", "-o", "int8"), ("speedup_fp8_vs_cudnn", "-^", "fp8"),
                                  ("speedup_bf16_vs_cudnn", "--s", "bf16")):
            pts = sorted((r["sparsity"], r[key]) for r in rows if r["shape"] == shape)
            ax.plot(*zip(*pts), style, label=f"{shape} {label}")
    ax.set_xlabel("sparsity (fraction of tiles skipped)")
    ax.set_ylabel("forward speed-up vs dense cuDNN SDPA (bf16)")
    ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title(f"sparsevid quantized vs bf16 block-sparse forward, {meta['gpu']}, {meta['commit']}")
    fig.tight_layout()
    return fig


def markdown(rows: list[dict]) -> str:
    lines = ["| shape | sparsity | cuDNN | bf16 | fp8 quant | fp8 kernel | fp8 all | int8 quant | int8 kernel | "
             "int8 all | predict | predict+int8 | predict+bf16 | int8 kernel x cuDNN | int8 all x cuDNN | "
             "predict+int8 x cuDNN | cos / rel L1 fp8 (gauss, video) | cos / rel L1 int8 (gauss, video) |",
             "|---" * 18 + "|"]
    for r in rows:
        acc = r["accuracy_vs_bf16"]
        cells = [r["shape"], f"{r['sparsity']:.3f}",
                 *(fmt(r[key]) if key in r else "" for key in (
                     "sdpa_cudnn_ms", "bf16_ms", "fp8_quant_ms", "fp8_kernel_ms", "fp8_ms", "int8_quant_ms",
                     "int8_kernel_ms", "int8_ms", "predict_ms", "predict_int8_ms", "predict_bf16_ms",
                     "speedup_int8_kernel_vs_cudnn", "speedup_int8_vs_cudnn", "speedup_predict_int8_vs_cudnn")),
                 *(", ".join(f"{acc[kind][p]['cosine']:.5f} / {acc[kind][p]['rel_l1']:.4f}"
                             for kind in ("gaussian", "video_like")) for p in QUANTIZED)]
        lines.append("| " + " | ".join(cells) + " |")
    quantizers = []
    for r in {r["shape"]: r for r in rows}.values():
        for p in QUANTIZED:
            kernels = ", ".join(f"{name} {us:.1f}" for name, us in r[f"{p}_quant_kernels_us"].items())
            quantizers.append(f"- {r['shape']}, {p}: {r[f'{p}_quant_ms']:.3f} ms, host {r[f'{p}_quant_host_us']:.0f} "
                              f"us per call; device us per kernel: {kernels}")
    return ("Forward times in ms (medians of triton.testing.do_bench); 'all' = quantization + kernel through the "
            "public API; predict = predict_mask (top-k) of the same mask; accuracy of each quantized output against "
            "the bf16 sparse kernel's.\n\n" + "\n".join(lines) + "\n\nQuantizers (do_bench, host time per call, "
            "device time of each kernel from torch.profiler):\n\n" + "\n".join(quantizers))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
