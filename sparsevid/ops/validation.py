"""Input checks shared by the ops: clear errors that name the argument, before any kernel runs."""
from __future__ import annotations

import math
import numbers
import os

import torch

TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_TRITON_HEAD_DIM = 256


def check_head_tensors(**tensors: torch.Tensor) -> None:
    """Each tensor is a floating-point [B, H, T, D] tensor; all share dtype, device, B, H and D; none is empty."""
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have shape [B, H, T, D], got {tuple(t.shape)}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
        if 0 in t.shape:
            raise ValueError(f"{name} must have non-empty dims, got shape {tuple(t.shape)}")
    names = ", ".join(tensors)
    first = next(iter(tensors.values()))
    if any(t.dtype != first.dtype for t in tensors.values()):
        raise TypeError(f"{names} must share one dtype, got {[t.dtype for t in tensors.values()]}")
    if any(t.device != first.device for t in tensors.values()):
        raise ValueError(f"{names} must be on one device, got {[str(t.device) for t in tensors.values()]}")
    if any(t.shape[:2] != first.shape[:2] or t.shape[-1] != first.shape[-1] for t in tensors.values()):
        raise ValueError(f"{names} must share [B, H] and the head dim D, got "
                         f"{[tuple(t.shape) for t in tensors.values()]}")


def grad_requested(*tensors: torch.Tensor) -> bool:
    """Whether autograd will record an op on these tensors (grad mode on and one of them requires grad)."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def check_scale(scale) -> None:
    """``scale`` is None or a finite number > 0 (an infinite scale turns every softmax row into NaN)."""
    if scale is not None and not (isinstance(scale, numbers.Real) and not isinstance(scale, bool)
                                  and 0 < scale < math.inf):
        raise ValueError(f"scale must be None or a positive finite number, got {scale!r}")


def check_choice(name: str, value, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def check_backend(backend, choices: tuple) -> None:
    """``backend`` is one of ``choices``; the error for "torch" names the plain-PyTorch backend's word."""
    if backend == "torch" and "reference" in choices:
        raise ValueError(f"backend must be one of {choices}, got 'torch': the plain-PyTorch backend is called "
                         f"'reference'")
    check_choice("backend", backend, choices)


def triton_runs_on(t: torch.Tensor) -> bool:
    """Whether Triton kernels can run on t's device: CUDA, or the CPU under ``TRITON_INTERPRET=1``."""
    return t.is_cuda or (t.device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") == "1")


def resolve_auto(backend: str, q: torch.Tensor, fallback: str) -> str:
    """The backend "auto" stands for on q's device: "triton" for CUDA tensors of a dtype and head dim the
    Triton kernels support, else ``fallback`` (other backends unchanged)."""
    if backend != "auto":
        return backend
    fits = q.dtype in TRITON_DTYPES and q.shape[-1] <= MAX_TRITON_HEAD_DIM
    return "triton" if q.is_cuda and fits else fallback


def check_triton_inputs(q: torch.Tensor) -> None:
    """Raise a clear error unless backend='triton' can run on q."""
    if not triton_runs_on(q):
        raise ValueError(f"backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1 on the CPU); q is on {q.device}")
    if q.dtype not in TRITON_DTYPES:
        raise TypeError(f"backend='triton' supports dtypes {TRITON_DTYPES}, got {q.dtype}")
    if q.shape[-1] > MAX_TRITON_HEAD_DIM:
        raise ValueError(f"backend='triton' supports head dims up to {MAX_TRITON_HEAD_DIM}, got {q.shape[-1]}")
