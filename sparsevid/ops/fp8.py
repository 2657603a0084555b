"""FP8 (e4m3) attention inputs: the quantized tensors and their scales, the scaling rules both the Triton path
and the PyTorch emulation follow, and the device requirement.

Scaling (SageAttention-style, per head):
    K is smoothed: k - mean over tokens (exact for softmax, which ignores a per-row constant q . mean; the row
        log-sum-exp adds it back), which removes the channel offsets that dominate K's range in video DiTs;
    Q and smoothed K have one scale per block of block_q / block_k tokens, V one per channel (over all tokens);
    Q is two fp8 terms, q / scale ~ q8 + q8_lo with q8_lo the rounded residual (q8 alone errs by up to 2^-4 of
        each element, the pair by about 2^-8): Q's rounding moves all logits of a row coherently and dominated the
        error; the kernel accumulates both products with K into one fp32 tile;
    P (in [0, 1] after max subtraction) is multiplied by ``P_SCALE`` before its cast, undone at the end.
Every scale is a power of two, the smallest that brings the amax (NaN ignored) within +-448 (:func:`scale_from_amax`):
dividing by it is exact in float32, so any implementation rounds the same values to e4m3 (e4m3 is a float format:
a scale up to 2x larger than amax / 448 costs no precision above the subnormal range, 2^-6 of the top).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from .caching import traceable_cache

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value
P_SCALE = 448.0  # P in [0, 1] is cast as P * P_SCALE: its largest entry (1) lands on the top of the range
# Compute capability with FP8 tensor-core instructions (Ada sm89, Hopper sm90 and newer).
FP8_MIN_CAPABILITY = (8, 9)
MIN_FP8_HEAD_DIM = 32  # an fp8 tensor-core product reduces over at least 32 elements


class Fp8Inputs(NamedTuple):
    """Quantized attention inputs. q8, q8_lo: fp8 [B, H, N, D] (Q and its residual); k8: fp8 [B, H, M, D]
    (smoothed K); v8: fp8 [B, H, M, D] (the Triton prep returns a view of a [B, H, D, M'] buffer: tokens
    contiguous); q_scale: float32 [B, H, ceil(N / block_q)]; k_scale: float32 [B, H, ceil(M / block_k)];
    v_scale: float32 [B, H, D]; k_mean: float32 [B, H, D]. Dequantized: (q8 + q8_lo) * q_scale (per query block),
    k8 * k_scale + k_mean (per key block), v8 * v_scale (per channel)."""
    q8: torch.Tensor
    q8_lo: torch.Tensor
    k8: torch.Tensor
    v8: torch.Tensor
    q_scale: torch.Tensor
    k_scale: torch.Tensor
    v_scale: torch.Tensor
    k_mean: torch.Tensor


def scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """float32 power-of-two scales 2^s of amax >= 0 (any shape): the smallest s in [-126, 127] with
    amax / 2^s <= FP8_MAX = 1.75 * 2^8, from amax's exponent and mantissa bits (no rounding); 1 where amax is 0."""
    bits = amax.float().contiguous().view(torch.int32)
    s = ((bits >> 23) & 0xFF) - 135 + ((bits & 0x7FFFFF) > 0x600000).int()
    scale = ((s.clamp(-126, 127) + 127) << 23).view(torch.float32)
    return torch.where(amax == 0, torch.ones_like(scale), scale)


def check_fp8_device(t: torch.Tensor, precision: str = "fp8") -> None:
    """Raise a clear error unless the Triton kernels of ``precision`` ("fp8" or "int8", whose P V product is fp8)
    can run on t's device (a CUDA GPU of compute capability >= 8.9, or the CPU under ``TRITON_INTERPRET=1``)."""
    from .validation import triton_runs_on

    if not triton_runs_on(t):
        raise ValueError(f"precision={precision!r} with backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1 on "
                         f"the CPU); q is on {t.device}")
    if t.is_cuda and not _has_fp8_tensor_cores(t.device):
        capability = torch.cuda.get_device_capability(t.device)
        name = torch.cuda.get_device_name(t.device)
        raise ValueError(f"precision={precision!r} needs a GPU with FP8 tensor cores (compute capability >= "
                         f"{FP8_MIN_CAPABILITY[0]}.{FP8_MIN_CAPABILITY[1]}: Ada, Hopper or newer); {name} has "
                         f"{capability[0]}.{capability[1]}; use precision='native'")


@traceable_cache()  # an lru_cache called under torch.compile makes dynamo warn
def _has_fp8_tensor_cores(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) >= FP8_MIN_CAPABILITY


def check_fp8_head_dim(d: int, precision: str = "fp8") -> None:
    if d < MIN_FP8_HEAD_DIM or d % 16:
        raise ValueError(f"precision={precision!r} needs a head dim that is a multiple of 16 and >= {MIN_FP8_HEAD_DIM}, "
                         f"got {d}")
