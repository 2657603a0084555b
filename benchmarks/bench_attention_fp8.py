"""FP8 block-sparse attention forward vs the bf16 (native) kernel on the same mask, and dense cuDNN SDPA.

For every shape and sparsity one random 128x64 block mask serves both precisions. Times (medians of
``triton.testing.do_bench``): the public FP8 call (quantization included), its quantization alone, the FP8
kernel alone on quantized inputs, the bf16 sparse kernel, dense cuDNN SDPA. Accuracy, on the timed full-size
inputs (Gaussian) and on video-like inputs (:func:`video_like_inputs`): cosine similarity and relative L1
error of the FP8 output against the bf16 sparse kernel's. Writes JSON, a Markdown table and the speed-up
figure under --out (:func:`benchmarks.report.write_result`) and prints the table.

    python -m benchmarks attention_fp8
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import sparsevid as sv
from sparsevid.ops import triton_fp8_attention
from .bench_attention import SHAPES, attention_flops, bench, fmt
from .report import write_result
from .run_info import run_metadata

# The accuracy targets against the bf16 sparse kernel (video-like inputs).
TARGET_COSINE, TARGET_REL_L1 = 0.999, 0.03


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


def accuracy(q, k, v, mask) -> dict[str, float]:
    """FP8 against the bf16 sparse kernel on the same inputs and mask."""
    fp8 = sv.block_sparse_attention(q, k, v, mask, precision="fp8")
    return output_metrics(fp8, sv.block_sparse_attention(q, k, v, mask))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder of the result (<gpu>.json/.md/.png)")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--sparsities", default="0.95,0.9,0.5,0")
    parser.add_argument("--block", default="128x64", help="block_q x block_k of the mask")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_attention_fp8.py needs a CUDA GPU")
    block_q, block_k = (int(s) for s in args.block.split("x"))
    meta = run_metadata("cuda", dtype="bfloat16 inputs; fp8 e4m3 products", block=args.block)
    print(json.dumps(meta), flush=True)
    rows, missed = [], []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for shape_name in args.shapes.split(","):
        b, h, n, d = SHAPES[shape_name]
        q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
        video = video_like_inputs(b, h, n, n, d, outlier=True, generator=gen)
        with torch.no_grad(), sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            cudnn_ms = bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v))
        with torch.no_grad():
            quant_ms = bench(lambda: triton_fp8_attention.quantize(q, k, v, block_q, block_k))
        for sparsity in (float(s) for s in args.sparsities.split(",")):
            mask = sv.random_block_mask(b, h, n, n, sparsity, block_q, block_k, device="cuda")
            with torch.no_grad():
                x = triton_fp8_attention.quantize(q, k, v, block_q, block_k)
                times = {
                    "bf16_ms": bench(lambda: sv.block_sparse_attention(q, k, v, mask)),
                    "fp8_ms": bench(lambda: sv.block_sparse_attention(q, k, v, mask, precision="fp8")),
                    "fp8_kernel_ms": bench(lambda: triton_fp8_attention.fp8_forward(
                        x, mask.kv_count, mask.kv_index, block_q, block_k, d ** -0.5, q)),
                }
                acc = {"gaussian": accuracy(q, k, v, mask), "video_like": accuracy(*video, mask)}
            flops = attention_flops(n, n, h, b, d, 1.0 - mask.sparsity, backward=False)
            row = {"shape": shape_name, "B": b, "H": h, "N": n, "D": d, "block": args.block,
                   "target_sparsity": sparsity, "sparsity": mask.sparsity, "sdpa_cudnn_ms": cudnn_ms,
                   "fp8_quant_ms": quant_ms, **times,
                   "fp8_kernel_tflops": flops / times["fp8_kernel_ms"] / 1e9,
                   "bf16_tflops": flops / times["bf16_ms"] / 1e9,
                   "speedup_fp8_vs_cudnn": cudnn_ms / times["fp8_ms"],
                   "speedup_bf16_vs_cudnn": cudnn_ms / times["bf16_ms"],
                   "speedup_fp8_vs_bf16": times["bf16_ms"] / times["fp8_ms"],
                   "speedup_fp8_kernel_vs_bf16": times["bf16_ms"] / times["fp8_kernel_ms"],
                   "fp8_config": str(triton_fp8_attention._bsa_fp8_fwd_kernel.best_config),
                   "accuracy_vs_bf16": acc}
            rows.append(row)
            print(json.dumps(row), flush=True)
            video_acc = acc["video_like"]
            if not (video_acc["cosine"] >= TARGET_COSINE and video_acc["rel_l1"] <= TARGET_REL_L1):
                missed.append(f"{shape_name} {sparsity}: {video_acc}")
    table = markdown(rows)
    write_result(args.out, meta, {"rows": rows}, table, figure(rows, meta))
    print(table)
    if missed:
        print("video-like accuracy below the targets:", *missed, sep="\n  ")
        return 1
    return 0


def figure(rows: list[dict], meta: dict):
    """Speed-up over dense cuDNN SDPA by sparsity: FP8 (quantization included) and bf16, one line per shape."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for shape in sorted({r["shape"] for r in rows}):
        for key, style, label in (("speedup_fp8_vs_cudnn", "-o", "fp8"), ("speedup_bf16_vs_cudnn", "--s", "bf16")):
            pts = sorted((r["sparsity"], r[key]) for r in rows if r["shape"] == shape)
            ax.plot(*zip(*pts), style, label=f"{shape} {label}")
    ax.set_xlabel("sparsity (fraction of tiles skipped)")
    ax.set_ylabel("forward speed-up vs dense cuDNN SDPA (bf16)")
    ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title(f"sparsevid FP8 vs bf16 block-sparse forward, {meta['gpu']}, {meta['commit']}")
    fig.tight_layout()
    return fig


def markdown(rows: list[dict]) -> str:
    lines = ["| shape | sparsity | cuDNN | bf16 sparse | fp8 (all) | fp8 quant | fp8 kernel | fp8 x cuDNN | "
             "bf16 x cuDNN | fp8 x bf16 | cos (gauss) | rel L1 (gauss) | cos (video) | rel L1 (video) |",
             "|---" * 14 + "|"]
    for r in rows:
        g, vl = r["accuracy_vs_bf16"]["gaussian"], r["accuracy_vs_bf16"]["video_like"]
        cells = [r["shape"], f"{r['sparsity']:.3f}",
                 *(fmt(r[key]) for key in ("sdpa_cudnn_ms", "bf16_ms", "fp8_ms", "fp8_quant_ms", "fp8_kernel_ms",
                                           "speedup_fp8_vs_cudnn", "speedup_bf16_vs_cudnn", "speedup_fp8_vs_bf16")),
                 f"{g['cosine']:.5f}", f"{g['rel_l1']:.4f}", f"{vl['cosine']:.5f}", f"{vl['rel_l1']:.4f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return ("Forward times in ms (medians of triton.testing.do_bench); fp8 (all) = quantization + kernel through "
            "the public API; accuracy of the fp8 output against the bf16 sparse kernel's.\n\n" + "\n".join(lines))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
