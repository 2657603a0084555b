"""Block pooling in plain PyTorch: block means, block self-similarity and pooled attention scores.

Block ``i`` of a length-``L`` sequence covers tokens ``i*block ... min((i+1)*block, L) - 1``; the last
block may be short and is pooled over its real tokens only.

Block self-similarity (how well a block's mean represents its tokens) is the mean cosine similarity of
the block's tokens to the block mean::

    sim = (1/n) * sum_i  <x_i, mu> / (max(|x_i|, eps) * max(|mu|, eps)),   mu = (1/n) * sum_i x_i

over the block's n real tokens, with ``eps = SIMILARITY_EPS``. It lies in [-1, 1], equals 1 when every
token points the way of the mean, and a zero token (or zero mean) contributes 0. Because the sum is
linear, it equals ``<mu / max(|mu|, eps), (1/n) * sum_i x_i / max(|x_i|, eps)>``, which a kernel computes
in the same single pass over the tokens as the mean.
"""
from __future__ import annotations

import torch

SIMILARITY_EPS = 1e-6


def _block_sums(x: torch.Tensor, block: int) -> torch.Tensor:
    """float32 [B, H, NB, D]: per-block sums of x [B, H, L, D] (any strides), the last block partial."""
    length = x.shape[-2]
    full = length // block
    parts = []
    if full:
        parts.append(x[..., : full * block, :].unflatten(-2, (full, block)).sum(dim=-2, dtype=torch.float32))
    if length % block:
        parts.append(x[..., full * block:, :].sum(dim=-2, keepdim=True, dtype=torch.float32))
    return torch.cat(parts, dim=-2) if len(parts) > 1 else parts[0]


def block_token_counts(length: int, block: int, device=None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[NB] of ``dtype``: number of real tokens in each block of a length-``length`` sequence. Computed on
    ``device`` (writing a Python number into one element of a CUDA tensor copies it from the host, which waits
    for the device)."""
    nb = (length + block - 1) // block
    starts = torch.arange(0, nb * block, block, dtype=dtype, device=device)
    return (length - starts).clamp_(max=block)


def pool_blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """float32 [B, H, ceil(L/block), D]: the mean of each block of tokens of x [B, H, L, D]."""
    counts = block_token_counts(x.shape[-2], block, x.device)
    return _block_sums(x, block) / counts[:, None]


def block_similarity(x: torch.Tensor, block: int, pooled: torch.Tensor) -> torch.Tensor:
    """float32 [B, H, ceil(L/block)]: block self-similarity (module docstring) of x [B, H, L, D].

    pooled: the block means of x, float32 [B, H, NB, D] (from :func:`pool_blocks`).
    """
    xf = x.float()
    unit = xf / xf.norm(dim=-1, keepdim=True).clamp_min(SIMILARITY_EPS)
    mean_unit = _block_sums(unit, block) / block_token_counts(x.shape[-2], block, x.device)[:, None]
    mean_dir = pooled / pooled.norm(dim=-1, keepdim=True).clamp_min(SIMILARITY_EPS)
    return (mean_dir * mean_unit).sum(dim=-1)


def pooled_scores(q_pooled: torch.Tensor, k_pooled: torch.Tensor, scale: float) -> torch.Tensor:
    """float32 [B, H, QB, KB]: softmax over key blocks of ``scale * q_pooled @ k_pooled^T``.

    q_pooled: float32 [B, H, QB, D]; k_pooled: float32 [B, H, KB, D].
    """
    logits = torch.matmul(q_pooled, k_pooled.transpose(-1, -2)) * scale
    return torch.softmax(logits, dim=-1)
