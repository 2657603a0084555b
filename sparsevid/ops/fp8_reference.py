"""FP8 block-sparse attention emulated in plain PyTorch: the same quantization as the Triton path
(:mod:`sparsevid.ops.fp8`), then exact (float64) arithmetic on the quantized values except the one rounding the
kernel adds inside the loop, P cast to fp8. The oracle of the FP8 kernel and ``precision="fp8"`` on the
"reference" backend (any device). :func:`emulate_attention` (the loop over dequantized inputs) and the per-block
helpers also serve ``precision="int8"``'s emulation (:mod:`sparsevid.ops.int8_reference`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .fp8 import FP8_DTYPE, FP8_MAX, P_SCALE, Fp8Inputs, scale_from_amax
from .mask import SparseMask

_MAX_CHUNK_ELEMENTS = 1 << 25  # score elements (float64) materialised at once


def _to_fp8(x: torch.Tensor) -> torch.Tensor:
    """Round float32 x (already scaled into range) to e4m3, saturating at +-FP8_MAX (NaN stays NaN)."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def _abs_max(x: torch.Tensor, dim) -> torch.Tensor:
    """amax of |x| over dim, NaN ignored (a NaN element stays NaN in its own fp8 value)."""
    return torch.where(torch.isnan(x), 0.0, x.abs()).amax(dim=dim)


def token_blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """x [B, H, T, D] as [B, H, ceil(T / block), block, D], the last block padded with zeros."""
    t = x.shape[2]
    nb = -(-t // block)
    return F.pad(x, (0, 0, 0, nb * block - t)).unflatten(2, (nb, block))


def unblock(x: torch.Tensor, t: int) -> torch.Tensor:
    """[B, H, NB, block, D] back to [B, H, t, D] (contiguous), the padding dropped."""
    return x.flatten(2, 3)[:, :, :t].contiguous()


def quantize_fp8_blocks(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block quantization of float32 x [B, H, T, D] over blocks of ``block`` tokens, one power-of-two scale
    each: (fp8 [B, H, T, D], float32 scales [B, H, ceil(T / block)])."""
    padded = token_blocks(x, block)
    scale = scale_from_amax(_abs_max(padded, (-2, -1)))
    return unblock(_to_fp8(padded / scale[..., None, None]), x.shape[2]), scale


def quantize_fp8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_q: int, block_k: int,
                 k_mean: torch.Tensor | None = None) -> Fp8Inputs:
    """The quantized inputs of FP8 attention by the rules of :mod:`sparsevid.ops.fp8`, in PyTorch.
    q: [B, H, N, D], k, v: [B, H, M, D] of any floating dtype. k_mean: float32 [B, H, D] to smooth K by
    (default: K's token mean; any vector keeps attention exact, so this takes the Triton prep's mean, whose
    float32 sum runs in another order)."""
    if k_mean is None:
        k_mean = k.mean(dim=2, dtype=torch.float32)
    q8, q_scale = quantize_fp8_blocks(q.float(), block_q)
    # q / q_scale - q8 is exact in float32 (two floats within a factor 2, or q8 = 0)
    q8_lo = _to_fp8(q.float() / q_scale.repeat_interleave(block_q, dim=2)[:, :, :q.shape[2], None] - q8.float())
    k8, k_scale = quantize_fp8_blocks(k.float() - k_mean[:, :, None], block_k)
    v_scale = scale_from_amax(_abs_max(v.float(), 2))
    v8 = _to_fp8(v.float() / v_scale[:, :, None])
    return Fp8Inputs(q8, q8_lo, k8, v8, q_scale, k_scale, v_scale, k_mean)


def dequantize_fp8(x: Fp8Inputs, block_q: int, block_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (its two terms), smoothed k and v in float64 from their fp8 values and the scales of blocks of
    block_q / block_k tokens: [B, H, N, D], [B, H, M, D] twice."""
    n, m = x.q8.shape[2], x.k8.shape[2]
    q = (x.q8.double() + x.q8_lo.double()) * x.q_scale.double().repeat_interleave(block_q, dim=2)[:, :, :n, None]
    k = x.k8.double() * x.k_scale.double().repeat_interleave(block_k, dim=2)[:, :, :m, None]
    v = x.v8.double() * x.v_scale.double()[:, :, None]
    return q, k, v


def emulate_fp8_attention(x: Fp8Inputs, mask: SparseMask, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`emulate_attention` of the dequantized inputs (lse with scale * q . k_mean added back)."""
    q, k, v = dequantize_fp8(x, mask.block_q, mask.block_k)
    return emulate_attention(q, k, v, scale * (q @ x.k_mean.double()[..., None]).squeeze(-1), mask, scale)


def emulate_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, row_shift: torch.Tensor, mask: SparseMask,
                      scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-sparse attention over dequantized float64 q [B, H, N, D], k, v [B, H, M, D], as the quantized kernels
    compute it: scores of q and k, P = exp(s - row max) rounded to fp8 as P * P_SCALE for the product with v, the
    row sum over the unrounded P. (The kernels subtract a running max, which changes which values P's rounding
    sees; their error stays of the same size.)

    Returns out float64 [B, H, N, D] and lse float64 [B, H, N] (natural log, plus row_shift float64 [B, H, N]:
    what K's smoothing took off the row's logits); a row with no kept tile gives zeros and lse -inf."""
    n, m = q.shape[2], k.shape[2]
    keep = mask.keep
    rows_per_chunk = max(mask.block_q, _MAX_CHUNK_ELEMENTS // max(1, q.shape[0] * q.shape[1] * m)
                         // mask.block_q * mask.block_q)
    outs, lses = [], []
    for start in range(0, n, rows_per_chunk):
        stop = min(start + rows_per_chunk, n)
        rows = keep[:, :, start // mask.block_q:-(-stop // mask.block_q)].repeat_interleave(mask.block_q, dim=2)
        allowed = rows.repeat_interleave(mask.block_k, dim=3)[:, :, :stop - start, :m]
        scores = (q[:, :, start:stop] @ k.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))
        empty = ~allowed.any(dim=-1)
        row_max = scores.amax(dim=-1, keepdim=True).masked_fill(empty[..., None], 0.0)
        p = torch.exp(scores - row_max)
        total = p.sum(dim=-1)
        p8 = _to_fp8((p * P_SCALE).float()).double() / P_SCALE
        outs.append((p8 @ v) / torch.where(empty, 1.0, total)[..., None])
        lses.append(torch.where(empty, float("-inf"), row_max.squeeze(-1) + torch.log(total)))
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2) + row_shift


def fp8_reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: SparseMask,
                            scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``precision="fp8"`` on the reference backend: :func:`quantize_fp8` then :func:`emulate_fp8_attention`.
    Returns out [B, H, N, D] in q's dtype and lse float32 [B, H, N]."""
    out, lse = emulate_fp8_attention(quantize_fp8(q, k, v, mask.block_q, mask.block_k), mask, scale)
    return out.to(q.dtype), lse.float()
