"""``block_sparse_attention``: the public op, its input checks and its backends.

Backends:
    "triton"     fused Triton kernels (CUDA; on the CPU only under ``TRITON_INTERPRET=1``),
                 registered as ``torch.ops.sparsevid.block_sparse_attn`` so ``torch.compile`` traces it;
    "flex"       the same mask through PyTorch's FlexAttention;
    "gather"     plain PyTorch over the kept tiles only (gathered key/value blocks), on any device;
    "reference"  plain PyTorch, dense masked scores chunked over query blocks, on any device: the oracle;
    "flash_attn4"  flash-attn-4's block-sparse forward and backward (optional dependency; Hopper, bf16/fp16):
                 FlashAttention-3's warp-specialised schedule on the mask's own tables (:mod:`.flash_attn4`);
    "auto"       "flash_attn4" where it can run the call (a Hopper GPU with flash-attn-4 installed, bf16/fp16, and
                 with gradients, blocks its backward tiles; no tile masses asked for): it is the faster of the two
                 there (docs/performance.md); else "triton" on CUDA, "gather" elsewhere.
"""
from __future__ import annotations

import functools

import torch

from .flash_attn4 import check_flash_attn4_request, flash_attn4_attention, flash_attn4_runs
from .fp8 import check_fp8_device, check_fp8_head_dim
from .fp8_reference import fp8_reference_attention
from .int8 import check_int8_head_dim
from .int8_reference import int8_reference_attention
from .gather_attention import gather_block_sparse_attention
from .mask import SparseMask
from .reference import reference_block_sparse_attention
from .validation import (check_backend, check_choice, check_head_tensors, check_scale, check_triton_inputs,
                         grad_requested, resolve_auto)

BACKENDS = ("auto", "triton", "flex", "gather", "reference", "flash_attn4")
# "native": products in the inputs' dtype (tensor cores for half types); the quantized precisions (forward only,
# on the "triton" (GPUs of compute capability >= 8.9) and "reference" backends): "fp8", both products on e4m3
# operands (:mod:`sparsevid.ops.fp8`); "int8", Q K^T on int8 operands and P V on e4m3 (:mod:`sparsevid.ops.int8`).
PRECISIONS = ("native", "fp8", "int8")
QUANTIZED_PRECISIONS = ("fp8", "int8")
FP8_BACKENDS = ("auto", "triton", "reference")  # the backends of the quantized precisions
TILE_MASS_BACKENDS = ("triton", "gather", "reference")  # those that can emit exact tile masses


# --------------------------------------------------------------------------- triton op (custom op + autograd)

@torch.library.custom_op("sparsevid::block_sparse_attn", mutates_args=())
def _triton_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_count: torch.Tensor,
                 kv_index: torch.Tensor, q_count: torch.Tensor, q_index: torch.Tensor, block_q: int,
                 block_k: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    from .triton_attention import triton_forward

    return triton_forward(q, k, v, kv_count, kv_index, block_q, block_k, scale)


@_triton_attn.register_fake
def _(q, k, v, kv_count, kv_index, q_count, q_index, block_q, block_k, scale):
    b, h, n, _ = q.shape
    return torch.empty_like(q), q.new_empty((b, h, n), dtype=torch.float32)


@torch.library.custom_op("sparsevid::block_sparse_attn_backward", mutates_args=())
def _triton_attn_backward(grad_out: torch.Tensor, grad_lse: torch.Tensor | None, q: torch.Tensor,
                          k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                          kv_count: torch.Tensor, kv_index: torch.Tensor, q_count: torch.Tensor,
                          q_index: torch.Tensor, block_q: int, block_k: int,
                          scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from .triton_attention import triton_backward

    return triton_backward(grad_out, grad_lse, q, k, v, out, lse, kv_count, kv_index, q_count, q_index,
                           block_q, block_k, scale)


@_triton_attn_backward.register_fake
def _(grad_out, grad_lse, q, k, v, out, lse, kv_count, kv_index, q_count, q_index, block_q, block_k, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, kv_count, kv_index, q_count, q_index, block_q, block_k, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, kv_count, kv_index, q_count, q_index)
    ctx.block_q, ctx.block_k, ctx.scale = block_q, block_k, scale


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, kv_count, kv_index, q_count, q_index = ctx.saved_tensors
    dq, dk, dv = _triton_attn_backward(grad_out, grad_lse, q, k, v, out, lse, kv_count, kv_index, q_count,
                                       q_index, ctx.block_q, ctx.block_k, ctx.scale)
    return dq, dk, dv, None, None, None, None, None, None, None


_triton_attn.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("sparsevid::block_sparse_attn_tile_mass", mutates_args=())
def _triton_attn_tile_mass(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_count: torch.Tensor,
                           kv_index: torch.Tensor, block_q: int, block_k: int, scale: float,
                           tile_slots: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward that also emits exact tile masses float32 [B, H, QB, KB]; tile_slots >= kv_count.max().
    Inference only: it has no backward (``block_sparse_attention`` refuses ``return_tile_mass=True`` when
    gradients are requested)."""
    from .triton_attention import triton_forward

    return triton_forward(q, k, v, kv_count, kv_index, block_q, block_k, scale, with_tile_mass=True,
                          tile_slots=tile_slots)


@_triton_attn_tile_mass.register_fake
def _(q, k, v, kv_count, kv_index, block_q, block_k, scale, tile_slots):
    b, h, n, _ = q.shape
    mass = q.new_empty((b, h, kv_index.shape[-2], kv_index.shape[-1]), dtype=torch.float32)
    return torch.empty_like(q), q.new_empty((b, h, n), dtype=torch.float32), mass


def _triton_backend(q, k, v, mask: SparseMask, scale: float, return_tile_mass: bool = False):
    needs_grad = grad_requested(q, k, v)
    if not needs_grad and not torch.compiler.is_compiling():
        # Eager inference launches the kernel directly: the custom ops serve autograd and torch.compile, and
        # their dispatch costs tens of microseconds of host time per call.
        from .triton_attention import triton_forward

        return triton_forward(q, k, v, mask.kv_count, mask.kv_index, mask.block_q, mask.block_k, scale,
                              with_tile_mass=return_tile_mass,
                              tile_slots=mask.max_kept_blocks if return_tile_mass else 0)
    if return_tile_mass:
        return _triton_attn_tile_mass(q, k, v, mask.kv_count, mask.kv_index, mask.block_q, mask.block_k, scale,
                                      mask.max_kept_blocks)
    # The transposed table (a sort over the block map) only serves the backward pass: build it only then.
    if needs_grad:
        q_count, q_index = mask.q_count, mask.q_index
    else:
        q_count, q_index = mask.kv_count.new_empty(0), mask.kv_index.new_empty(0)
    return _triton_attn(q, k, v, mask.kv_count, mask.kv_index, q_count, q_index, mask.block_q, mask.block_k, scale)


@torch.library.custom_op("sparsevid::block_sparse_attn_quantized", mutates_args=())
def _triton_attn_quantized(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_count: torch.Tensor,
                           kv_index: torch.Tensor, block_q: int, block_k: int, scale: float,
                           precision: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward of a quantized precision ("fp8" or "int8", quantization included); no backward."""
    return _triton_quantized(q, k, v, kv_count, kv_index, block_q, block_k, scale, precision)


@_triton_attn_quantized.register_fake
def _(q, k, v, kv_count, kv_index, block_q, block_k, scale, precision):
    b, h, n, _ = q.shape
    return torch.empty_like(q), q.new_empty((b, h, n), dtype=torch.float32)


def _triton_quantized(q, k, v, kv_count, kv_index, block_q: int, block_k: int, scale: float, precision: str):
    if precision == "int8":
        from .triton_int8_attention import triton_int8_attention as attend
    else:
        from .triton_fp8_attention import triton_fp8_attention as attend
    return attend(q, k, v, kv_count, kv_index, block_q, block_k, scale)


def _quantized_backend(q, k, v, mask: SparseMask, scale: float, backend: str, precision: str):
    if backend == "reference":
        attend = int8_reference_attention if precision == "int8" else fp8_reference_attention
        return attend(q, k, v, mask, scale)
    run = _triton_attn_quantized if torch.compiler.is_compiling() else _triton_quantized
    return run(q, k, v, mask.kv_count, mask.kv_index, mask.block_q, mask.block_k, scale, precision)


# --------------------------------------------------------------------------- flex backend

@functools.lru_cache(maxsize=None)
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def _flex_kernel_options(mask: SparseMask) -> dict[str, int]:
    """FlexAttention's CUDA forward walks the block mask in tiles of its own, which must divide the mask's
    blocks; its default is 128 for some head dims. Pin the tiles along a 64-block side to 64."""
    options = {}
    if mask.block_q == 64:
        options["fwd_BLOCK_M"] = 64
    if mask.block_k == 64:
        options["fwd_BLOCK_N"] = 64
    return options


def _flex_backend(q, k, v, mask: SparseMask, scale: float):
    from torch.nn.attention.flex_attention import flex_attention

    if not grad_requested(q, k, v):  # on the CPU FlexAttention refuses inputs that require grad even then
        q, k, v = q.detach(), k.detach(), v.detach()
    attend = _compiled_flex() if q.is_cuda else flex_attention
    out, aux = attend(q, k, v, block_mask=mask.to_flex(), scale=scale, return_aux=_lse_request(),
                      kernel_options=_flex_kernel_options(mask) if q.is_cuda else None)
    return out, aux.lse


@functools.lru_cache(maxsize=None)
def _lse_request():
    from torch.nn.attention.flex_attention import AuxRequest

    return AuxRequest(lse=True)


# --------------------------------------------------------------------------- public op

def _check_flex_gradients(mask: SparseMask, q: torch.Tensor) -> None:
    """FlexAttention has no backward on the CPU, and on CUDA its backward (PyTorch 2.11) picks its tiles
    before it honours kernel options, whose defaults do not divide 64-blocks: refuse what would fail deep in
    torch."""
    if not q.is_cuda:
        raise ValueError(f"backend='flex' computes gradients only on CUDA (FlexAttention has no backward on "
                         f"{q.device.type}); use backend='reference' or 'triton', or call under torch.no_grad()")
    if (mask.block_q, mask.block_k) != (128, 128):
        raise ValueError(f"backend='flex' on CUDA computes gradients only for 128x128 blocks, got a "
                         f"{mask.block_q}x{mask.block_k} mask; use backend='triton' (or call under torch.no_grad())")


def _check_inputs(q, k, v, mask, scale, backend) -> None:
    check_head_tensors(q=q, k=k, v=v)
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if not isinstance(mask, SparseMask):
        raise TypeError(f"mask must be a sparsevid.SparseMask, got {type(mask).__name__}")
    mask.check_compatible(q.shape[0], q.shape[1], q.shape[2], k.shape[2], q.device)
    check_scale(scale)
    check_backend(backend, BACKENDS)
    if backend == "triton":
        check_triton_inputs(q)
    if backend == "flex" and grad_requested(q, k, v):
        _check_flex_gradients(mask, q)
    if backend == "flash_attn4":
        check_flash_attn4_request(q, k, v, mask)


def resolve_backend(backend: str, q: torch.Tensor) -> str:
    """The backend "auto" stands for on q's device, before flash-attn-4 is considered (others unchanged)."""
    return resolve_auto(backend, q, "gather")


def call_backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: SparseMask, backend: str = "auto",
                 return_tile_mass: bool = False) -> str:
    """The backend a native-precision :func:`block_sparse_attention` call with these arguments runs on: ``backend``
    itself unless it is "auto", which is "flash_attn4" where that can run the call and no tile masses are asked for,
    else :func:`resolve_backend`'s choice. (Gradients count as requested when grad mode is on and an input requires
    grad, as in the call; with gradients under ``torch.use_deterministic_algorithms`` "auto" keeps the Triton kernels,
    whose backward is deterministic, where flash-attn-4's accumulates dq by atomics: :func:`flash_attn4_runs`.)"""
    if backend == "auto" and q.is_cuda and not return_tile_mass and flash_attn4_runs(q, k, v, mask):
        return "flash_attn4"
    return resolve_backend(backend, q)


def _check_quantized_request(precision: str, backend: str, q, k, v, return_tile_mass: bool) -> None:
    """Clear errors for what a quantized precision cannot do, before anything runs (backend already resolved)."""
    if backend not in FP8_BACKENDS:
        raise ValueError(f"precision={precision!r} runs on the backends {FP8_BACKENDS[1:]} (or 'auto'), got "
                         f"{backend!r}")
    if grad_requested(q, k, v):
        raise ValueError(f"precision={precision!r} is a forward for inference (no backward): call it under "
                         "torch.no_grad() or with inputs that do not require grad, or use precision='native' for "
                         "training")
    if return_tile_mass:
        raise ValueError("return_tile_mass=True needs precision='native'")
    check_fp8_head_dim(q.shape[-1], precision)
    if precision == "int8":
        check_int8_head_dim(q.shape[-1])
    if backend == "triton":
        check_fp8_device(q, precision)


def resolve_fp8_backend(backend: str, q: torch.Tensor) -> str:
    """The backend "auto" stands for with a quantized precision: "triton" on CUDA, "reference" elsewhere."""
    return ("triton" if q.is_cuda else "reference") if backend == "auto" else backend


def _check_flags(return_lse, return_tile_mass) -> None:
    for name, flag in (("return_lse", return_lse), ("return_tile_mass", return_tile_mass)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {flag!r}")


def _check_tile_mass_request(return_tile_mass: bool, backend: str, q, k, v) -> None:
    if not return_tile_mass:
        return
    if backend not in TILE_MASS_BACKENDS:
        raise ValueError(f"return_tile_mass=True needs one of the backends {TILE_MASS_BACKENDS} (or 'auto'), "
                         f"got {backend!r}")
    if grad_requested(q, k, v):
        raise ValueError("return_tile_mass=True is inference only (no backward): call it under torch.no_grad() "
                         "or with inputs that do not require grad")


def block_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: SparseMask,
                           scale: float | None = None, return_lse: bool = False, backend: str = "auto",
                           return_tile_mass: bool = False, precision: str = "native"):
    """softmax(scale * q k^T restricted to the mask's kept tiles) @ v.

    Args:
        q: [B, H, N, D]; k, v: [B, H, M, D] (same layout as ``scaled_dot_product_attention``; strided views
            such as a transposed [B, N, H, D] tensor are read without a copy).
        mask: a :class:`SparseMask` for lengths (N, M), broadcastable over B and H.
        scale: softmax scale, default ``D ** -0.5``.
        return_lse: also return the row log-sum-exp (natural log), float32 [B, H, N].
        backend: "auto" | "triton" | "flex" | "gather" | "reference" | "flash_attn4" (flash-attn-4 installed, a
            Hopper GPU, bf16 or fp16; ValueError or ImportError otherwise; gradients as below). "auto" takes
            "flash_attn4" where it can run the call (module docstring), else "triton" on CUDA, "gather" elsewhere.
        return_tile_mass: also return the exact softmax mass of every tile, float32 [B, H, QB, KB]: the mean
            over query block i's rows of the probability the row gives key block j (0 for skipped tiles; each
            row-block sums to 1 over its kept tiles, or 0 if it keeps none). Triton, gather and reference backends,
            inference only (ValueError if gradients are requested). The Triton variant is a separate custom op
            (``torch.ops.sparsevid.block_sparse_attn_tile_mass``) that sizes its scratch by ``mask.max_kept_blocks``
            (read from the device once per mask).
        precision: "native" (products in the inputs' dtype), "fp8" or "int8", the quantized forwards:
            "fp8": both products on e4m3 operands with fp32 accumulation, K smoothed by its token mean, per-block
            scales for Q (two e4m3 terms) and K, per-channel scales for V (:mod:`sparsevid.ops.fp8`);
            "int8": Q K^T on int8 operands with int32 accumulation (Q one scale per token, K smoothed by the mean of
            256 sampled keys and one scale per key block), P V on e4m3 operands with fp32 accumulation (V one
            power-of-two scale per key block) (:mod:`sparsevid.ops.int8`).
            Both: forward only (ValueError when gradients are requested), backends "triton" (a GPU of compute
            capability >= 8.9; ValueError on older ones) and "reference" (a PyTorch emulation of the same
            quantization; "auto" picks it off CUDA), head dims multiples of 16, >= 32 (and <= 256 for "int8").
            "fp8": a non-finite key or value spreads over its head (it enters K's mean and V's channel scales);
            "int8": a non-finite query gives its row NaN, a non-finite key every row that keeps its block (and, if
            it is among the sampled keys, its head), a NaN value the rows that weigh it.

    Returns:
        out [B, H, N, D] in q's dtype, then lse when ``return_lse``, then the tile masses when
        ``return_tile_mass`` (a tuple when more than out is returned). A row with no kept tile outputs zeros
        and lse = -inf (a mask from ``predict_mask`` keeps at least ``min_blocks`` tiles in every row).
        Non-finite inputs give what dense attention gives on the kept tiles: a NaN in q makes its row NaN.

    Gradients (q, k and v; not with tile masses): "triton" (CUDA, or the CPU under the Triton interpreter)
    "gather" and "reference" (any device) differentiate everywhere; "flex" only on CUDA and only for 128x128 blocks;
    "flash_attn4" with the blocks its backward tiles: at head dims up to 128, 128-token key blocks and query blocks
    a multiple of 64 (ValueError otherwise, before any kernel runs).
    """
    check_choice("precision", precision, PRECISIONS)
    # A quantized precision's backend is checked against its own backends below (the native checks would not apply).
    _check_inputs(q, k, v, mask, scale, backend if precision == "native" else "auto")
    _check_flags(return_lse, return_tile_mass)
    scale = float(scale) if scale is not None else q.shape[-1] ** -0.5
    if precision in QUANTIZED_PRECISIONS:
        backend = resolve_fp8_backend(backend, q)
        _check_quantized_request(precision, backend, q, k, v, return_tile_mass)
        out, lse = _quantized_backend(q, k, v, mask, scale, backend, precision)
        return (out, lse) if return_lse else out
    backend = call_backend(q, k, v, mask, backend, return_tile_mass)
    _check_tile_mass_request(return_tile_mass, backend, q, k, v)
    if backend == "triton":
        out, lse, *mass = _triton_backend(q, k, v, mask, scale, return_tile_mass)
    elif backend == "flex":
        (out, lse), mass = _flex_backend(q, k, v, mask, scale), []
    elif backend == "flash_attn4":
        (out, lse), mass = flash_attn4_attention(q, k, v, mask, scale), []
    elif backend == "gather":
        out, lse, *mass = gather_block_sparse_attention(q, k, v, mask, scale, return_tile_mass)
    else:
        out, lse, *mass = reference_block_sparse_attention(q, k, v, mask, scale, return_tile_mass)
    if not (return_lse or return_tile_mass):
        return out
    return (out,) + ((lse,) if return_lse else ()) + (tuple(mass) if return_tile_mass else ())
