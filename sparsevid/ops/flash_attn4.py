"""``backend="flash_attn4"``: the block-sparse forward of flash-attn-4 (``pip install flash-attn-4``: FlashAttention's
CuTe DSL kernels, FlashAttention-3's warp-specialised schedule on Hopper) on the mask's own count and index tables.

An optional dependency, on Hopper GPUs (compute capability 9.0) with bf16 or fp16 inputs. Every kept tile goes in
as one of flash-attn-4's "full" blocks (attended without a mask function), so the tables need no conversion beyond
int32 and no host-side planning: a mask predicted at every step costs nothing more. flash-attn-4 masks keys past the
sequence's end in the first block it takes of a row, the row's highest index; a ``SparseMask`` lists each row's
blocks in ascending order, so a ragged last key block is masked where it is kept.

Gradients run flash-attn-4's Hopper backward on the transposed tables (per key block, the query blocks that keep
it), also as "full" blocks, which it masks at the sequence's end wherever they fall. Its tiles fix the blocks it can
train with: key blocks exactly its backward tile's width (128 tokens at head dims up to 128) and query blocks a
multiple of its tile's height (:func:`flash_attn4_backward_blocks`). Its backward accumulates dq by atomic adds (not
deterministic): under ``torch.use_deterministic_algorithms(True)`` a request for gradients is refused with a
RuntimeError (in warn-only mode it runs with a warning), and ``backend="auto"`` keeps the Triton kernels for it.
"""
from __future__ import annotations

import functools
import warnings
from typing import Optional

import torch

from .mask import SparseMask
from .validation import grad_requested

FLASH_ATTN4_DTYPES = (torch.bfloat16, torch.float16)
FLASH_ATTN4_CAPABILITY = (9, 0)  # its block sparsity fits the tile to the mask's blocks on sm90 only
MAX_FLASH_ATTN4_HEAD_DIM = 256
FLASH_ATTN4_HEAD_DIM_ALIGNMENT = 8  # 16-byte rows of 16-bit elements


def flash_attn4_tables(count: torch.Tensor, index: torch.Tensor) -> dict[str, torch.Tensor]:
    """One of a mask's tables as flash-attn-4's block-sparsity tensors: the forward's (int32 kv_count [B', H', QB],
    kv_index [B', H', QB, KB]) or the backward's (q_count [B', H', KB], q_index [B', H', KB, QB]). Every kept tile
    is a "full" block (the table as it is; its padding past each count is not read), and there are no partial
    ("mask") blocks: their counts zero and their index table one column wide (compact tables are allowed)."""
    no_count, no_index = _no_partial_blocks(tuple(count.shape), count.device)
    return {"mask_block_cnt": no_count, "mask_block_idx": no_index, "full_block_cnt": count,
            "full_block_idx": index}


@functools.lru_cache(maxsize=16)
def _no_partial_blocks(count_shape: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero counts int32 [B', H', QB] and a one-column index table int32 [B', H', QB, 1], made once per shape
    (read-only; called inside the custom ops, which torch.compile does not trace), not by two fills per call."""
    count = torch.zeros(count_shape, dtype=torch.int32, device=device)
    return count, count.unsqueeze(-1)


def check_flash_attn4_request(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: SparseMask) -> None:
    """Raise a clear error unless ``backend="flash_attn4"`` can run on q, k, v ([B, H, T, D], already checked as
    head tensors) and ``mask``: flash-attn-4 installed, a Hopper GPU, bf16 or fp16, a supported head dim, and with
    gradients requested, blocks its backward can tile."""
    problem = flash_attn4_problem(q, k, v, mask)
    if problem is not None:
        error_type, message = problem
        raise error_type(message)
    if _deterministic_gradients(q, k, v):
        message = ("backend='flash_attn4' accumulates dq by atomic adds in no fixed order: its gradients are not "
                   "deterministic, which torch.use_deterministic_algorithms(True) forbids (backend='triton' is "
                   "deterministic)")
        if not _deterministic_warn_only():
            raise RuntimeError(message)
        warnings.warn(message, UserWarning, stacklevel=3)


def _deterministic_gradients(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the call asks for gradients under ``torch.use_deterministic_algorithms`` (strict or warn-only).
    torch.compile traces are_deterministic_algorithms_enabled as a guarded constant; the warn-only query it cannot
    trace (:func:`_deterministic_warn_only`) is asked only after this."""
    return torch.are_deterministic_algorithms_enabled() and grad_requested(q, k, v)


@torch.compiler.assume_constant_result  # torch.compile cannot trace the query itself
def _deterministic_warn_only() -> bool:
    return torch.is_deterministic_algorithms_warn_only_enabled()


def flash_attn4_runs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: SparseMask) -> bool:
    """Whether ``backend="auto"`` should run this call on flash-attn-4: it can, and the call does not ask for gradients
    under ``torch.use_deterministic_algorithms`` (in warn-only mode too; the Triton backward is deterministic)."""
    return not _deterministic_gradients(q, k, v) and flash_attn4_problem(q, k, v, mask) is None


def flash_attn4_problem(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        mask: SparseMask) -> tuple[type[Exception], str] | None:
    """Why ``backend="flash_attn4"`` cannot run on q, k, v and ``mask`` (the error's type and message, the checks of
    :func:`check_flash_attn4_request` in its order), or None if it can. No exception is made here: torch.compile
    traces this for ``backend="auto"``."""
    if q.dtype not in FLASH_ATTN4_DTYPES:
        return TypeError, f"backend='flash_attn4' supports dtypes {FLASH_ATTN4_DTYPES}, got {q.dtype}"
    head_dim = q.shape[-1]
    if head_dim > MAX_FLASH_ATTN4_HEAD_DIM or head_dim % FLASH_ATTN4_HEAD_DIM_ALIGNMENT:
        return ValueError, (f"backend='flash_attn4' supports head dims that are multiples of "
                            f"{FLASH_ATTN4_HEAD_DIM_ALIGNMENT} up to {MAX_FLASH_ATTN4_HEAD_DIM}, got {head_dim}")
    if not q.is_cuda:
        return ValueError, f"backend='flash_attn4' needs CUDA tensors, q is on {q.device}"
    problem, missing_package = _device_problem(q.device.index)  # a CUDA tensor's device always has its index
    if problem:
        return (ImportError if missing_package else ValueError), problem
    if grad_requested(q, k, v):
        tile_q, block_k = flash_attn4_backward_blocks(head_dim, mask.block_q)
        if mask.block_k != block_k or mask.block_q % tile_q:
            return ValueError, (f"backend='flash_attn4' computes gradients at head dim {head_dim} for key blocks of "
                                f"{block_k} tokens and query blocks a multiple of {tile_q} (its backward's tiles), "
                                f"got a {mask.block_q}x{mask.block_k} mask: use backend='triton', or call under "
                                f"torch.no_grad()")
    return None


@torch.compiler.assume_constant_result  # traced as its constant: torch.compile need not enter flash-attn-4's config
@functools.lru_cache(maxsize=None)
def flash_attn4_backward_blocks(head_dim: int, block_q: int) -> tuple[int, int]:
    """(query tile height, key block width) of flash-attn-4's Hopper backward at ``head_dim`` for ``block_q``-row
    blocks, as flash-attn-4 itself chooses them: query blocks must be a multiple of the first, key blocks equal the
    second (one sparse key block per tile). Needs flash-attn-4 installed."""
    from flash_attn.cute.config import select_sm90_bwd_tile

    tile = select_sm90_bwd_tile(head_dim, head_dim, False, False, block_q)
    return tile["tile_m"], tile["tile_n"]


@torch.compiler.assume_constant_result  # traced as the constant it returns: the machine does not change
@functools.lru_cache(maxsize=None)
def _device_problem(device_index: int) -> tuple[str, bool]:
    """Why flash-attn-4's block-sparse forward cannot run on CUDA device ``device_index`` ("" if it can), and
    whether the reason is the package missing."""
    capability = torch.cuda.get_device_capability(device_index)
    if capability != FLASH_ATTN4_CAPABILITY:
        return (f"backend='flash_attn4' runs on Hopper GPUs (compute capability 9.0); "
                f"{torch.cuda.get_device_name(device_index)} has {capability[0]}.{capability[1]}: use "
                f"backend='triton'", False)
    try:
        import flash_attn.cute  # noqa: F401
    except Exception as error:  # noqa: BLE001 (a broken install, e.g. mismatched CUDA bindings, raises its own types)
        return ("backend='flash_attn4' needs flash-attn-4 (`pip install flash-attn-4`), which does not import here: "
                f"{type(error).__name__}: {error}", True)
    return "", False


def _flash_attn4_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_count: torch.Tensor,
                         kv_index: torch.Tensor, block_q: int, block_k: int,
                         scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """flash-attn-4's block-sparse forward on the kv tables: out [B, H, N, D] (a view of a contiguous [B, N, H, D]
    tensor) and lse float32 [B, H, N]."""
    from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch
    from flash_attn.cute.interface import flash_attn_func

    sparse = BlockSparseTensorsTorch(**flash_attn4_tables(kv_count, kv_index), block_size=(block_q, block_k))
    # flash-attn-4 takes [B, T, H, D] (sparsevid's [B, H, T, D] as a strided view, no copy)
    out, lse = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=scale,
                               block_sparse_tensors=sparse, return_lse=True)
    return out.transpose(1, 2), lse


@torch.library.custom_op("sparsevid::block_sparse_attn_flash_attn4", mutates_args=())
def _flash_attn4_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_count: torch.Tensor,
                    kv_index: torch.Tensor, q_count: Optional[torch.Tensor], q_index: Optional[torch.Tensor],
                    block_q: int, block_k: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _flash_attn4_forward(q, k, v, kv_count, kv_index, block_q, block_k, scale)


@_flash_attn4_op.register_fake
def _(q, k, v, kv_count, kv_index, q_count, q_index, block_q, block_k, scale):
    b, h, n, d = q.shape
    return q.new_empty((b, n, h, d)).transpose(1, 2), q.new_empty((b, h, n), dtype=torch.float32)


@torch.library.custom_op("sparsevid::block_sparse_attn_flash_attn4_backward", mutates_args=())
def _flash_attn4_backward_op(grad_out: torch.Tensor, grad_lse: Optional[torch.Tensor], q: torch.Tensor,
                             k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                             q_count: torch.Tensor, q_index: torch.Tensor, block_q: int, block_k: int,
                             scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch
    from flash_attn.cute.interface import _flash_attn_bwd

    sparse = BlockSparseTensorsTorch(**flash_attn4_tables(q_count, q_index), block_size=(block_q, block_k))
    grads = _flash_attn_bwd(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), out.transpose(1, 2),
                            grad_out.transpose(1, 2), lse, scale, block_sparse_tensors=sparse, dlse=grad_lse)
    return tuple(_strided_like(x, g.transpose(1, 2)) for x, g in zip((q, k, v), grads))


def _strided_like(reference: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` with ``reference``'s strides (as the fake kernel promises): flash-attn-4 allocates each gradient
    like its input, so this copies only where it had to make an input contiguous first."""
    return tensor if tensor.stride() == reference.stride() else torch.empty_like(reference).copy_(tensor)


@_flash_attn4_backward_op.register_fake
def _(grad_out, grad_lse, q, k, v, out, lse, q_count, q_index, block_q, block_k, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, kv_count, kv_index, q_count, q_index, block_q, block_k, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, q_count, q_index)
    ctx.block_q, ctx.block_k, ctx.scale = block_q, block_k, scale


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, q_count, q_index = ctx.saved_tensors
    dq, dk, dv = _flash_attn4_backward_op(grad_out, grad_lse, q, k, v, out, lse, q_count, q_index, ctx.block_q,
                                          ctx.block_k, ctx.scale)
    return dq, dk, dv, None, None, None, None, None, None, None


_flash_attn4_op.register_autograd(_backward, setup_context=_setup_context)


def flash_attn4_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: SparseMask,
                          scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(scale * q k^T on the kept tiles) @ v by flash-attn-4, differentiable in q, k, v (and through lse).
    q: [B, H, N, D], k, v: [B, H, M, D] (checked by :func:`check_flash_attn4_request`). Returns out [B, H, N, D]
    (q's dtype; a view of a [B, N, H, D] tensor) and lse float32 [B, H, N]. The transposed tables the backward
    reads are made only when gradients are requested."""
    if not grad_requested(q, k, v):
        if not torch.compiler.is_compiling():
            # Eager inference calls flash-attn-4 directly: the custom ops serve autograd and torch.compile, and their
            # dispatch costs tens of microseconds of host time per call.
            return _flash_attn4_forward(q, k, v, mask.kv_count, mask.kv_index, mask.block_q, mask.block_k, scale)
        return _flash_attn4_op(q, k, v, mask.kv_count, mask.kv_index, None, None, mask.block_q, mask.block_k, scale)
    return _flash_attn4_op(q, k, v, mask.kv_count, mask.kv_index, mask.q_count, mask.q_index, mask.block_q,
                           mask.block_k, scale)  # the tables int32 already
