"""Block-sparse attention in plain PyTorch: the obviously-right backend, on any device.

Query blocks are processed in chunks so that no [N, M] score matrix is ever built for long sequences;
when gradients are needed each chunk is recomputed in the backward pass (activation checkpointing),
so memory stays at one chunk's scores.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .mask import SparseMask
from .validation import grad_requested

# Upper bound on the number of score elements materialised at once (per chunk, all batches and heads).
_MAX_CHUNK_ELEMENTS = 1 << 26


def _tile_mass(probs: torch.Tensor, block_q: int, block_k: int) -> torch.Tensor:
    """float32 [B, H, ceil(n/block_q), KB]: the mean over each query block's rows of the probability mass
    each key block receives, from row probabilities ``probs`` [B, H, n, M]."""
    n, m = probs.shape[-2:]
    qb, kb = -(-n // block_q), -(-m // block_k)
    padded = F.pad(probs, (0, kb * block_k - m, 0, qb * block_q - n))
    sums = padded.unflatten(-1, (kb, block_k)).sum(-1).unflatten(-2, (qb, block_q)).sum(-2)
    rows = torch.full((qb, 1), float(block_q), dtype=sums.dtype, device=sums.device)
    rows[-1] = n - (qb - 1) * block_q
    return (sums / rows).float()


def _chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep_rows: torch.Tensor,
                     block_k: int, scale: float, block_q: int = 0) -> tuple[torch.Tensor, ...]:
    """Attention of one chunk of query rows.

    q: [B, H, n, D]; k, v: [B, H, M, D]; keep_rows: bool [B|1, H|1, n, KB] (block map per row).
    Returns out [B, H, n, D] in q's dtype and lse [B, H, n] (float32; float64 for float64 q); with a
    ``block_q`` > 0 also the tile masses float32 [B, H, ceil(n/block_q), KB] (see :func:`_tile_mass`).
    """
    m = k.shape[-2]
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    scores = torch.matmul(q.to(compute), k.to(compute).transpose(-1, -2)) * scale
    allowed = keep_rows.repeat_interleave(block_k, dim=-1)[..., :m]
    scores = scores.masked_fill(~allowed, float("-inf"))
    # Rows with no kept tile get probabilities 0, output 0 and lse -inf, with finite gradients.
    empty = ~allowed.any(dim=-1)
    row_max = scores.amax(dim=-1, keepdim=True).masked_fill(empty.unsqueeze(-1), 0.0).detach()
    weights = torch.exp(scores - row_max)
    total = weights.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(compute).tiny)
    probs = weights / total
    out = torch.matmul(probs, v.to(compute))
    lse = (row_max + torch.log(total)).squeeze(-1)
    lse = torch.where(empty, torch.full_like(lse, float("-inf")), lse)
    result = (out.to(q.dtype), lse.to(torch.promote_types(q.dtype, torch.float32)))
    if block_q:
        result += (_tile_mass(probs, block_q, block_k),)
    return result


def reference_block_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: SparseMask,
                                     scale: float, return_tile_mass: bool = False) -> tuple[torch.Tensor, ...]:
    """Block-sparse attention by dense masked scores, chunked over query blocks.

    q: [B, H, N, D], k/v: [B, H, M, D] (any strides). Returns out [B, H, N, D] (q's dtype)
    and lse [B, H, N] (float32; float64 for float64 q). Differentiable by autograd.
    With ``return_tile_mass`` (no gradients) also the exact tile masses float32 [B, H, QB, KB]: the mean over
    each query block's rows of the attention probability that each key block receives (0 for skipped tiles).
    """
    if return_tile_mass:
        with torch.no_grad():
            parts = _chunks(q, k, v, mask, scale, needs_grad=False, block_q=mask.block_q)
        return tuple(torch.cat(p, dim=d) for p, d in zip(parts, (-2, -1, -2)))
    outs, lses = _chunks(q, k, v, mask, scale, needs_grad=grad_requested(q, k, v))
    return torch.cat(outs, dim=-2), torch.cat(lses, dim=-1)


def _chunks(q, k, v, mask: SparseMask, scale: float, needs_grad: bool, block_q: int = 0) -> tuple[list, ...]:
    """Per chunk of query blocks, the outputs of :func:`_chunk_attention`, as lists (out, lse[, mass])."""
    b, h, n, _ = q.shape
    m = k.shape[-2]
    rows_per_chunk = max(1, _MAX_CHUNK_ELEMENTS // max(1, b * h * m))
    blocks_per_chunk = max(1, rows_per_chunk // mask.block_q)
    keep = mask.keep
    parts = []
    for first_block in range(0, mask.num_q_blocks, blocks_per_chunk):
        last_block = min(first_block + blocks_per_chunk, mask.num_q_blocks)
        start, stop = first_block * mask.block_q, min(last_block * mask.block_q, n)
        keep_rows = keep[:, :, first_block:last_block].repeat_interleave(mask.block_q, dim=-2)
        keep_rows = keep_rows[:, :, : stop - start]
        q_chunk = q[:, :, start:stop]
        if needs_grad:
            parts.append(checkpoint(_chunk_attention, q_chunk, k, v, keep_rows, mask.block_k, scale,
                                    use_reentrant=False))
        else:
            parts.append(_chunk_attention(q_chunk, k, v, keep_rows, mask.block_k, scale, block_q))
    return tuple(zip(*parts))
