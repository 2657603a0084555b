"""precision="int8": attention inputs for INT8 Q K^T (int32 accumulation) and FP8 (e4m3) P V, and the scaling
rules that the Triton path and the PyTorch emulation both follow.

What is int8 and what is fp8:
    Q, one scale per token (row), int8 in [-127, 127], quantized by the launch that quantizes K and V;
    K, smoothed by a vector mu (below) and given one scale per block of block_k tokens, int8;
    the product Q K^T on int8 tensor cores with exact int32 accumulation;
    V, one power-of-two scale per head (all tokens and channels), e4m3;
    P (in [0, 1] after max subtraction) times ``P_SCALE``, e4m3; the product P V in fp32.
Int8 is fixed point, 127 steps up to the amax: on Gaussian-like rows its rounding error is about 4x smaller
than e4m3's (3 mantissa bits), so one int8 term replaces the two e4m3 terms of ``precision="fp8"``'s Q.

Int8 scale of a row or block x: s = amax(|x|) / 127 (float32, correctly rounded), 1 where amax is 0 and NaN where
x holds a non-finite element, so that a NaN or inf in a query row makes that row NaN, and one in a key block every
row that keeps the tile, as in dense attention. K's blocks round x / s (correctly rounded division) half to even;
Q's rows round x * (127 / amax) (the reciprocal correctly rounded; the product rounded once, in the FMA that
rounds it to an integer): either way each element is within half a step of its value.

Smoothing: mu is the mean of ``SMOOTH_SAMPLES`` keys evenly spaced over the sequence (:func:`smoothing_tokens`),
not of all keys: any vector subtracted from every key leaves the softmax exact (the row's lse adds
scale * q . mu back), and the sample removes the channel offsets shared by all tokens, which is what smoothing is
for, without a pass over all of K before K can be quantized.

V's scale per head: e4m3 is floating point, so one scale costs a value nothing as long as it stays above the
subnormals (2^-6 of the top, 448 / 2^-6 = 2^14.8 of range: a channel or a token 30x wider than the others costs
them nothing), and every tile of a head shares V's unit, so the kernel takes two tiles per step with one rescale of
its accumulator and lets the tensor cores sum both products. It is the power of two from the amax of V's
finite values (computed per chunk of tokens by the launch that computes K's smoothing vector); NaN and inf in V
become NaN, so that the rows that keep their tile are NaN, as for K.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

INT8_MAX = 127
SMOOTH_SAMPLES = 256  # keys averaged into K's smoothing vector
# The kernels convert the int32 logits to float32, exact while |logit| <= 127^2 * D < 2^24; head dims up to 256
# keep it below 2^22.
MAX_INT8_HEAD_DIM = 256


class Int8Inputs(NamedTuple):
    """Quantized K and V of ``precision="int8"``. k8: int8 [B, H, M, D] (smoothed K); v8: fp8 e4m3 [B, H, M, D]
    (the Triton prep returns a view of a [B, H, D, M'] buffer: tokens contiguous); k_scale, v_scale: float32
    [B, H, ceil(M / block_k)] and [B, H]; k_mean: float32 [B, H, D] (mu). Dequantized: k8 * k_scale + k_mean (per key
    block) and v8 * v_scale (per head)."""
    k8: torch.Tensor
    v8: torch.Tensor
    k_scale: torch.Tensor
    v_scale: torch.Tensor
    k_mean: torch.Tensor


class Int8Queries(NamedTuple):
    """Quantized Q of ``precision="int8"``. q8: int8 [B, H, N, D]; q_scale: float32 [B, H, N] (one per row);
    q_shift: float32 [B, H, N], q . mu of the unquantized rows (mu: :attr:`Int8Inputs.k_mean`), what smoothing
    took off every logit of the row (the lse adds scale * q_shift back). Dequantized: q8 * q_scale."""
    q8: torch.Tensor
    q_scale: torch.Tensor
    q_shift: torch.Tensor


def smoothing_tokens(m: int, device=None) -> torch.Tensor:
    """int64 [min(m, SMOOTH_SAMPLES)]: the keys whose mean smooths K, (j * m) // SMOOTH_SAMPLES for
    j < SMOOTH_SAMPLES (every key when m <= SMOOTH_SAMPLES)."""
    samples = min(m, SMOOTH_SAMPLES)
    return torch.arange(samples, device=device) * m // samples


def int8_scale(amax: torch.Tensor, finite: torch.Tensor) -> torch.Tensor:
    """float32 scales amax / 127 of rows or blocks with float32 amax >= 0 (any shape); 1 where amax is 0, NaN
    where ``finite`` (bool, same shape) is False."""
    scale = torch.where(amax == 0, torch.ones_like(amax), amax / torch.full_like(amax, INT8_MAX))
    return torch.where(finite, scale, torch.full_like(scale, float("nan")))


def round_to_int8(y: torch.Tensor) -> torch.Tensor:
    """int8 round-half-even(y) of y already scaled into [-127, 127] (any float dtype), 0 where y is not finite."""
    r = torch.round(y).clamp(-INT8_MAX, INT8_MAX)
    return torch.where(torch.isfinite(r), r, torch.zeros_like(r)).to(torch.int8)


def check_int8_head_dim(d: int) -> None:
    if d > MAX_INT8_HEAD_DIM:
        raise ValueError(f"precision='int8' needs a head dim <= {MAX_INT8_HEAD_DIM} (exact int32 logits in float32), "
                         f"got {d}")
