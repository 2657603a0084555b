"""precision="int8" emulated in plain PyTorch: the quantization of :mod:`sparsevid.ops.int8`, then float64
arithmetic on the quantized values except P's cast to fp8 (:func:`fp8_reference.emulate_attention`). The oracle of
the Triton int8 path and ``precision="int8"`` on the "reference" backend (any device).
"""
from __future__ import annotations

import torch

from .fp8 import scale_from_amax
from .fp8_reference import _abs_max, _to_fp8, emulate_attention, token_blocks, unblock
from .int8 import INT8_MAX, Int8Inputs, Int8Queries, int8_scale, round_to_int8, smoothing_tokens
from .mask import SparseMask


def quantize_int8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 [..., T, D] and float32 scales [..., T]: one int8 scale per row of float32 x [..., T, D], each element
    x / scale rounded (K's blocks)."""
    scale = int8_scale(_abs_max(x, -1), torch.isfinite(x).all(dim=-1))
    return round_to_int8(x / scale[..., None]), scale


def quantize_q_rows(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 [B, H, N, D] and float32 scales [B, H, N] of q [B, H, N, D] as the kernel quantizes it: one scale per
    row, each element q * (127 / amax) rounded once (the float32 product is exact in float64)."""
    x = q.float()
    amax = _abs_max(x, -1)
    inv = torch.full_like(amax, INT8_MAX) / amax
    return round_to_int8(x.double() * inv.double()[..., None]), int8_scale(amax, torch.isfinite(x).all(dim=-1))


def quantize_int8_q(q: torch.Tensor, k_mean: torch.Tensor) -> Int8Queries:
    """Q [B, H, N, D] (any float dtype) quantized per row (:func:`quantize_q_rows`), with its rows' smoothing
    shift q . k_mean (k_mean: float32 [B, H, D]) summed in float32."""
    q8, q_scale = quantize_q_rows(q)
    return Int8Queries(q8, q_scale, (q.float() * k_mean[:, :, None]).sum(-1))


def quantize_int8_kv(k: torch.Tensor, v: torch.Tensor, block_k: int,
                     k_mean: torch.Tensor | None = None) -> Int8Inputs:
    """K and V [B, H, M, D] (any float dtype) quantized by the rules of :mod:`sparsevid.ops.int8`. k_mean: float32
    [B, H, D] to smooth K by (default: the mean of the keys :func:`smoothing_tokens` picks; the Triton prep's
    float32 sum runs in another order)."""
    m = k.shape[2]
    if k_mean is None:
        k_mean = k[:, :, smoothing_tokens(m, k.device)].float().mean(dim=2)
    k_blocks = token_blocks(k.float() - k_mean[:, :, None], block_k)
    b, h, nb, block, d = k_blocks.shape
    k8, k_scale = quantize_int8_rows(k_blocks.reshape(b, h, nb, block * d))
    v8, v_scale = quantize_v_per_head(v)
    return Int8Inputs(unblock(k8.view(b, h, nb, block, d), m), v8, k_scale, v_scale, k_mean)


def quantize_v_per_head(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """V [B, H, M, D] (any float dtype) as e4m3 in units of one power-of-two scale per head from the amax of its
    finite values; NaN and inf become NaN. Returns (fp8 [B, H, M, D], float32 scales [B, H])."""
    x = v.float()
    finite = torch.isfinite(x)
    scale = scale_from_amax(torch.where(finite, x.abs(), 0.0).amax(dim=(2, 3)))
    return _to_fp8(torch.where(finite, x / scale[:, :, None, None], float("nan"))), scale


def dequantize_int8(q: torch.Tensor, x: Int8Inputs, block_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (quantized per row as the kernel does), smoothed k and v in float64: [B, H, N, D], [B, H, M, D] twice."""
    q8, q_scale = quantize_q_rows(q)
    m = x.k8.shape[2]
    per_key = x.k_scale.double().repeat_interleave(block_k, dim=2)[:, :, :m, None]
    return (q8.double() * q_scale.double()[..., None], x.k8.double() * per_key,
            x.v8.double() * x.v_scale.double()[:, :, None, None])


def emulate_int8_attention(q: torch.Tensor, x: Int8Inputs, mask: SparseMask,
                           scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-sparse attention of q [B, H, N, D] over quantized K and V, as the int8 kernel computes it. Returns out
    float64 [B, H, N, D] and lse float64 [B, H, N] (scale * q . k_mean, of the unquantized q, added back)."""
    dq, dk, dv = dequantize_int8(q, x, mask.block_k)
    row_shift = scale * (q.double() @ x.k_mean.double()[..., None]).squeeze(-1)
    return emulate_attention(dq, dk, dv, row_shift, mask, scale)


def int8_reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: SparseMask,
                             scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``precision="int8"`` on the reference backend. Returns out [B, H, N, D] in q's dtype and lse float32
    [B, H, N]."""
    out, lse = emulate_int8_attention(q, quantize_int8_kv(k, v, mask.block_k), mask, scale)
    return out.to(q.dtype), lse.float()
