"""``backend="flash_attn4"``: the block-sparse forward of flash-attn-4 (``pip install flash-attn-4``: FlashAttention's
CuTe DSL kernels, FlashAttention-3's warp-specialised schedule on Hopper) on the mask's own count and index tables.

An optional dependency, forward only (inference), on Hopper GPUs (compute capability 9.0) with bf16 or fp16 inputs.
Every kept tile goes in as one of flash-attn-4's "full" blocks (attended without a mask function), so the tables
need no conversion beyond int32 and no host-side planning: a mask predicted at every step costs nothing more.
flash-attn-4 masks keys past the sequence's end in the first block it takes of a row, the row's highest index; a
``SparseMask`` lists each row's blocks in ascending order, so a ragged last key block is masked where it is kept.
"""
from __future__ import annotations

import functools

import torch

from .mask import SparseMask
from .validation import grad_requested

FLASH_ATTN4_DTYPES = (torch.bfloat16, torch.float16)
FLASH_ATTN4_CAPABILITY = (9, 0)  # its block sparsity fits the tile to the mask's blocks on sm90 only
MAX_FLASH_ATTN4_HEAD_DIM = 256
FLASH_ATTN4_HEAD_DIM_ALIGNMENT = 8  # 16-byte rows of 16-bit elements


def flash_attn4_tables(kv_count: torch.Tensor, kv_index: torch.Tensor) -> dict[str, torch.Tensor]:
    """A mask's tables (int32 kv_count [B', H', QB], kv_index [B', H', QB, KB]) as flash-attn-4's block-sparsity
    tensors: every kept tile a "full" block (the table as it is; its padding past each count is not read), and no
    partial ("mask") blocks: their counts zero and their index table one column wide (compact tables are
    allowed)."""
    no_count, no_index = _no_partial_blocks(tuple(kv_count.shape), kv_count.device)
    return {"mask_block_cnt": no_count, "mask_block_idx": no_index, "full_block_cnt": kv_count,
            "full_block_idx": kv_index}


@functools.lru_cache(maxsize=16)
def _no_partial_blocks(count_shape: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero counts int32 [B', H', QB] and a one-column index table int32 [B', H', QB, 1], made once per shape
    (read-only; called inside the custom op, which torch.compile does not trace), not by two fills per call."""
    count = torch.zeros(count_shape, dtype=torch.int32, device=device)
    return count, count.unsqueeze(-1)


def check_flash_attn4_request(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Raise a clear error unless ``backend="flash_attn4"`` can run on q, k, v ([B, H, T, D], already checked as
    head tensors): flash-attn-4 installed, a Hopper GPU, bf16 or fp16, a supported head dim, no gradients."""
    if grad_requested(q, k, v):
        raise ValueError("backend='flash_attn4' is a forward for inference (no backward): call it under "
                         "torch.no_grad() or with inputs that do not require grad, or use backend='triton' for "
                         "training")
    if q.dtype not in FLASH_ATTN4_DTYPES:
        raise TypeError(f"backend='flash_attn4' supports dtypes {FLASH_ATTN4_DTYPES}, got {q.dtype}")
    head_dim = q.shape[-1]
    if head_dim > MAX_FLASH_ATTN4_HEAD_DIM or head_dim % FLASH_ATTN4_HEAD_DIM_ALIGNMENT:
        raise ValueError(f"backend='flash_attn4' supports head dims that are multiples of "
                         f"{FLASH_ATTN4_HEAD_DIM_ALIGNMENT} up to {MAX_FLASH_ATTN4_HEAD_DIM}, got {head_dim}")
    if not q.is_cuda:
        raise ValueError(f"backend='flash_attn4' needs CUDA tensors, q is on {q.device}")
    problem, missing_package = _device_problem(q.device.index)  # a CUDA tensor's device always has its index
    if problem:
        raise (ImportError if missing_package else ValueError)(problem)


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
    except ImportError as error:
        return ("backend='flash_attn4' needs flash-attn-4 (`pip install flash-attn-4`), which does not import here: "
                f"{error}", True)
    return "", False


@torch.library.custom_op("sparsevid::block_sparse_attn_flash_attn4", mutates_args=())
def _flash_attn4_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_count: torch.Tensor,
                    kv_index: torch.Tensor, block_q: int, block_k: int,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch
    from flash_attn.cute.interface import flash_attn_func

    sparse = BlockSparseTensorsTorch(**flash_attn4_tables(kv_count, kv_index), block_size=(block_q, block_k))
    # flash-attn-4 takes [B, T, H, D] (sparsevid's [B, H, T, D] as a strided view, no copy) and writes out as a
    # contiguous [B, N, H, D] tensor, returned as its [B, H, N, D] view; lse float32 [B, H, N]
    out, lse = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=scale,
                               block_sparse_tensors=sparse, return_lse=True)
    return out.transpose(1, 2), lse


@_flash_attn4_op.register_fake
def _(q, k, v, kv_count, kv_index, block_q, block_k, scale):
    b, h, n, d = q.shape
    return q.new_empty((b, n, h, d)).transpose(1, 2), q.new_empty((b, h, n), dtype=torch.float32)


def flash_attn4_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: SparseMask,
                          scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(scale * q k^T on the kept tiles) @ v by flash-attn-4. q: [B, H, N, D], k, v: [B, H, M, D] (checked
    by :func:`check_flash_attn4_request`). Returns out [B, H, N, D] (q's dtype; a view of a [B, N, H, D] tensor)
    and lse float32 [B, H, N]."""
    return _flash_attn4_op(q, k, v, mask.kv_count.to(torch.int32), mask.kv_index.to(torch.int32), mask.block_q,
                           mask.block_k, scale)
