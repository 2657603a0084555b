"""The quantized and block-sparse peers beside sparsevid's forwards, on the same inputs and masks: what ran, how
fast and how close, and why the others did not.

Peers (each optional: a failed import or call is recorded with its reason and the others still run):

- SageAttention (``sageattention``, Triton: dense attention with INT8 Q K^T per block and K smoothing): its dense
  time, and that time times the kept share, what a block-sparse kernel at SageAttention's speed per tile would take.
- FlashInfer's block-sparse attention (``flashinfer``, kernels compiled at first use with a CUDA compiler), on
  sparsevid's per-head mask as block rows (BSR).
- SpargeAttn (``spas_sage_attn``, built from source: block-sparse SageAttention2), on the same mask.

sparsevid's bf16 and int8 forwards and dense cuDNN SDPA run in the same process on the same Gaussian inputs; the
mask is ``predict_mask``'s top-k at 1 - sparsity, 128x64 tiles. Accuracy: cosine similarity and relative L1 of each
output against sparsevid's bf16 output on the same mask (SageAttention, dense: against cuDNN's).

    python -m benchmarks attention_peers
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import sparsevid as sv
from .bench_attention import SHAPES, bench
from .bench_attention_fp8 import output_metrics
from .report import write_result
from .run_info import run_metadata


def bsr_rows(mask: sv.SparseMask) -> tuple[torch.Tensor, torch.Tensor]:
    """The mask's kept key blocks as block rows: (indptr int32 [B, H, QB + 1], offsets into one indices table;
    indices int32 [kept tiles]), rows in (batch, head, query block) order, each row's key blocks in the mask's
    order."""
    count, index = mask.kv_count.long(), mask.kv_index.long()
    ends = count.flatten().cumsum(0).view(count.shape)
    indptr = torch.cat([ends - count, ends[..., -1:]], dim=-1)
    kept = torch.arange(index.shape[-1], device=index.device) < count[..., None]
    return indptr.int(), index[kept].int()


def sage_dense(q, k, v, mask):
    """SageAttention's dense call (the mask is not used: SageAttention has no block-sparse form)."""
    from sageattention import sageattn

    return lambda: sageattn(q, k, v, tensor_layout="HND", is_causal=False)


def flashinfer_sparse(q, k, v, mask):
    """FlashInfer's one-shot block-sparse attention over [B, N, H, D] with the mask's block rows."""
    from flashinfer.attention.prims_ts import block_sparse_attention

    indptr, indices = bsr_rows(mask)
    qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    return lambda: block_sparse_attention(qt, kt, vt, indptr, indices, mask.block_q, mask.block_k).transpose(1, 2)


def sparge_sparse(q, k, v, mask):
    """SpargeAttn's block-sparse SageAttention2 with the mask as a dense [B, H, QB, KB] block map."""
    from spas_sage_attn import block_sparse_sage2_attn_cuda

    blocks = mask.to_dense().to(torch.int8)
    return lambda: block_sparse_sage2_attn_cuda(q, k, v, mask_id=blocks)


PEERS = {"sageattention (dense)": sage_dense, "flashinfer block-sparse": flashinfer_sparse,
         "spargeattn block-sparse": sparge_sparse}


def peer_row(name: str, q, k, v, mask, reference: torch.Tensor) -> dict:
    """One peer on one mask: its ms and accuracy against ``reference``, or why it did not run."""
    try:
        call = PEERS[name](q, k, v, mask)
        with torch.no_grad():
            out = call()
            torch.cuda.synchronize()
            return {"peer": name, "ran": True, "ms": bench(call), **output_metrics(out, reference)}
    except Exception as error:  # recorded: the point of this benchmark is what runs where
        return {"peer": name, "ran": False, "why": f"{type(error).__name__}: {error}"[:300]}


def rows_for(shape: str, sparsity: float, block_q: int, block_k: int, generator) -> list[dict]:
    """sparsevid's forwards, cuDNN and every peer at one shape and sparsity."""
    b, h, n, d = SHAPES[shape]
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=generator) for _ in range(3))
    mask = sv.predict_mask(q, k, rule="topk", topk=1.0 - sparsity, block_q=block_q, block_k=block_k)[0]
    with torch.no_grad():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            dense = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v)  # noqa: E731
            dense_out, cudnn_ms = dense(), bench(dense)
        ours = sv.block_sparse_attention(q, k, v, mask)
        common = {"shape": shape, "sparsity": mask.sparsity, "cudnn_ms": cudnn_ms}
        rows = [{**common, "peer": "sparsevid bf16", "ran": True,
                 "ms": bench(lambda: sv.block_sparse_attention(q, k, v, mask))},
                {**common, "peer": "sparsevid int8", "ran": True,
                 "ms": bench(lambda: sv.block_sparse_attention(q, k, v, mask, precision="int8")),
                 **output_metrics(sv.block_sparse_attention(q, k, v, mask, precision="int8"), ours)}]
    for name in PEERS:
        reference = dense_out if name.endswith("(dense)") else ours
        rows.append({**common, **peer_row(name, q, k, v, mask, reference)})
    kept = 1.0 - mask.sparsity
    for row in rows:
        if row["ran"]:
            row["x_cudnn"] = cudnn_ms / row["ms"]
            if row["peer"].endswith("(dense)"):
                row["ms_at_kept_share"] = row["ms"] * kept
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| shape | sparsity | peer | ms | x cuDNN | dense ms x kept share | cosine / rel L1 | why not |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ran = r["ran"]
        accuracy = f"{r['cosine']:.5f} / {r['rel_l1']:.4f}" if "cosine" in r else "-"
        lines.append(f"| {r['shape']} | {r['sparsity']:.3f} | {r['peer']} | {r['ms']:.3f} | {r['x_cudnn']:.1f}x | "
                     f"{r.get('ms_at_kept_share', float('nan')):.3f} | {accuracy} | |" if ran else
                     f"| {r['shape']} | {r['sparsity']:.3f} | {r['peer']} | - | - | - | - | {r['why']} |")
    return "\n".join(lines).replace("| nan |", "| - |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder of the result (<gpu>.json/.md)")
    parser.add_argument("--shapes", default="wan1.3b-480p")
    parser.add_argument("--sparsities", default="0.95,0.9")
    parser.add_argument("--block", default="128x64", help="block_q x block_k of the mask")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_attention_peers.py needs a CUDA GPU")
    block_q, block_k = (int(s) for s in args.block.split("x"))
    meta = run_metadata("cuda", dtype="bfloat16 inputs", block=args.block)
    generator = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for shape in args.shapes.split(","):
        for sparsity in (float(s) for s in args.sparsities.split(",")):
            rows += rows_for(shape, sparsity, block_q, block_k, generator)
            write_result(args.out, meta, {"rows": rows}, markdown(rows))
    print(json.dumps(meta))
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
