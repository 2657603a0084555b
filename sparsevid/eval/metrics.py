"""Exact mask-quality metrics: attention recall of a block mask and the error of the sparse output.

All of them work on any q, k, v [B, H, T, D] and never build an N x M score matrix at once: scores are
computed a chunk of query blocks at a time.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..ops import SparseMask, block_sparse_attention

# Upper bound on the number of score elements materialised at once (all batches and heads of a chunk).
_MAX_CHUNK_ELEMENTS = 1 << 26


def attention_recall(q: torch.Tensor, k: torch.Tensor, mask: SparseMask, scale: float | None = None) -> torch.Tensor:
    """Mean over query rows of the true softmax attention mass that the mask's kept tiles hold.

    q: [B, H, N, D], k: [B, H, M, D]; mask: a SparseMask for (N, M), broadcastable over B and H.
    Scores are computed in float32 (float64 for float64 inputs) with scale (default D ** -0.5).
    Returns recall [B, H] in [0, 1] (float32, or float64 for float64 inputs).
    """
    b, h, n, d = q.shape
    m = k.shape[2]
    mask.check_compatible(b, h, n, m, q.device)
    scale = float(scale) if scale is not None else d ** -0.5
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    k_c = k.to(compute)
    rows = max(mask.block_q, _MAX_CHUNK_ELEMENTS // max(1, b * h * m) // mask.block_q * mask.block_q)
    total = torch.zeros(b, h, dtype=compute, device=q.device)
    for start in range(0, n, rows):
        stop = min(start + rows, n)
        scores = torch.matmul(q[:, :, start:stop].to(compute), k_c.transpose(-1, -2)) * scale
        blocks = mask.keep[:, :, start // mask.block_q: -(-stop // mask.block_q)]
        allowed = blocks.repeat_interleave(mask.block_q, dim=-2)[:, :, : stop - start]
        allowed = allowed.repeat_interleave(mask.block_k, dim=-1)[..., :m]
        kept = torch.logsumexp(scores.masked_fill(~allowed, float("-inf")), dim=-1)
        total += torch.exp(kept - torch.logsumexp(scores, dim=-1)).sum(dim=-1)
    return total / n


def relative_l1(out: torch.Tensor, ref: torch.Tensor) -> float:
    """sum |out - ref| / sum |ref|, accumulated in float64."""
    out, ref = out.double(), ref.double()
    return float((out - ref).abs().sum() / ref.abs().sum())


def cosine_similarity(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Cosine similarity of out and ref flattened to vectors, in float64."""
    return float(F.cosine_similarity(out.double().flatten(), ref.double().flatten(), dim=0))


def sparse_output_error(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: SparseMask,
                        scale: float | None = None, backend: str = "auto") -> dict[str, float]:
    """Relative L1 and cosine similarity of block-sparse attention against dense attention.

    q: [B, H, N, D], k, v: [B, H, M, D]. The sparse output comes from ``block_sparse_attention`` on
    ``backend``, the dense one from ``scaled_dot_product_attention``, both in q's dtype.
    Returns {"relative_l1": float, "cosine": float}.
    """
    sparse = block_sparse_attention(q, k, v, mask, scale=scale, backend=backend)
    dense = F.scaled_dot_product_attention(q, k, v, scale=scale)
    return {"relative_l1": relative_l1(sparse, dense), "cosine": cosine_similarity(sparse, dense)}
