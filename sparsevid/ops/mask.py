"""Block-level attention masks and the index tables the kernels consume.

A :class:`SparseMask` says, for every (query block, key block) tile, whether the tile is kept.
Query block ``i`` covers rows ``i*block_q ... min((i+1)*block_q, q_len) - 1`` and key block ``j``
covers columns ``j*block_k ... min((j+1)*block_k, kv_len) - 1``; the last block may be short.
The leading batch and head dimensions may be 1 and then broadcast over the attention inputs.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass, field

import torch

from .pooling import block_token_counts

SUPPORTED_BLOCK_SIZES = (64, 128)
# The tile sizes a mask (and a mask prediction) has unless given others.
DEFAULT_BLOCK_Q, DEFAULT_BLOCK_K = 128, 64


def num_blocks(length: int, block: int) -> int:
    """Number of blocks of size ``block`` that cover ``length`` tokens (the last may be short)."""
    return (length + block - 1) // block


def check_block_size(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value not in SUPPORTED_BLOCK_SIZES:
        raise ValueError(f"{name} must be one of {SUPPORTED_BLOCK_SIZES}, got {value!r}")


def _check_length(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def kept_index_table(keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Compress a bool block map into per-row counts and ascending indices of kept columns.

    keep: bool [..., R, C]. Returns ``count`` int32 [..., R] and ``index`` int32 [..., R, C]
    whose first ``count[..., r]`` entries are the kept columns of row ``r`` in ascending order;
    the remaining entries repeat the last kept column (or 0 for empty rows) so that a kernel
    prefetching one entry past the end still reads a valid block.
    """
    count = keep.sum(dim=-1, dtype=torch.int32)
    # Stable sort of "not kept" puts the kept columns first, in ascending column order.
    order = torch.sort((~keep).to(torch.uint8), dim=-1, stable=True).indices
    index = order.to(torch.int32)
    last = (count.long() - 1).clamp_min(0).unsqueeze(-1)
    last_kept = torch.gather(index, -1, last)
    cols = torch.arange(keep.shape[-1], device=keep.device)
    index = torch.where(cols < count.unsqueeze(-1), index, last_kept)
    return count.contiguous(), index.contiguous()


@dataclass(frozen=True, eq=False)
class SparseMask:
    """A block-sparse attention mask.

    Attributes:
        keep: bool [B or 1, H or 1, ceil(q_len/block_q), ceil(kv_len/block_k)].
        q_len, kv_len: token lengths N and M the mask was made for.
        block_q, block_k: tile sizes in tokens (64 or 128).

    The index tables are built on first use, on the mask's device:
        kv_count int32 [B', H', QB], kv_index int32 [B', H', QB, KB] (kept key blocks per query block);
        q_count int32 [B', H', KB], q_index int32 [B', H', KB, QB] (the transpose, for the backward pass).
    """

    keep: torch.Tensor
    q_len: int
    kv_len: int
    block_q: int = DEFAULT_BLOCK_Q
    block_k: int = DEFAULT_BLOCK_K
    _tables: dict = field(default_factory=dict, repr=False, compare=False)  # index tables, max_kept_blocks

    def __post_init__(self) -> None:
        _check_length("q_len", self.q_len)
        _check_length("kv_len", self.kv_len)
        check_block_size("block_q", self.block_q)
        check_block_size("block_k", self.block_k)
        keep = self.keep
        if not isinstance(keep, torch.Tensor):
            raise TypeError(f"keep must be a torch.Tensor, got {type(keep).__name__}")
        if keep.dtype != torch.bool:
            raise TypeError(f"keep must be a bool tensor, got dtype {keep.dtype}")
        if keep.dim() != 4:
            raise ValueError(f"keep must have 4 dims [B, H, q_blocks, kv_blocks], got shape {tuple(keep.shape)}")
        if 0 in keep.shape[:2]:
            raise ValueError(f"keep must have non-empty batch and head dims, got shape {tuple(keep.shape)}")
        expected = (num_blocks(self.q_len, self.block_q), num_blocks(self.kv_len, self.block_k))
        if tuple(keep.shape[-2:]) != expected:
            raise ValueError(
                f"keep's last two dims must be (ceil(q_len/block_q), ceil(kv_len/block_k)) = {expected} "
                f"for q_len={self.q_len}, kv_len={self.kv_len}, block_q={self.block_q}, "
                f"block_k={self.block_k}; got {tuple(keep.shape[-2:])}"
            )

    @classmethod
    def from_dense(cls, keep: torch.Tensor, q_len: int, kv_len: int, block_q: int = DEFAULT_BLOCK_Q,
                   block_k: int = DEFAULT_BLOCK_K,
                   kv_table: tuple[torch.Tensor, torch.Tensor] | None = None) -> "SparseMask":
        """Build a mask from a bool block map ``keep`` [B|1, H|1, QB, KB] (see the class docstring).

        kv_table: optional precomputed ``(kv_count, kv_index)`` for ``keep``, laid out exactly as
        :func:`kept_index_table` builds them (int32 [B', H', QB] and [B', H', QB, KB]); the mask then
        uses them instead of building its own.
        """
        mask = cls(keep=keep, q_len=q_len, kv_len=kv_len, block_q=block_q, block_k=block_k)
        if kv_table is not None:
            if not (isinstance(kv_table, (tuple, list)) and len(kv_table) == 2
                    and all(isinstance(t, torch.Tensor) for t in kv_table)):
                raise TypeError(f"kv_table must be a (kv_count, kv_index) pair of tensors, got {kv_table!r}")
            count, index = kv_table
            if count.device != keep.device or index.device != keep.device:
                raise ValueError(f"kv_table must be on keep's device {keep.device}, got {count.device} and "
                                 f"{index.device}")
            if (count.dtype, index.dtype) != (torch.int32, torch.int32):
                raise TypeError(f"kv_table must hold int32 tensors, got {count.dtype} and {index.dtype}")
            if tuple(count.shape) != tuple(keep.shape[:-1]) or tuple(index.shape) != tuple(keep.shape):
                raise ValueError(
                    f"kv_table shapes must be {tuple(keep.shape[:-1])} and {tuple(keep.shape)}, "
                    f"got {tuple(count.shape)} and {tuple(index.shape)}"
                )
            mask._tables["kv"] = (count, index)
        return mask

    @classmethod
    def full(cls, q_len: int, kv_len: int, block_q: int = DEFAULT_BLOCK_Q, block_k: int = DEFAULT_BLOCK_K,
             device: torch.device | str | None = None) -> "SparseMask":
        """A mask that keeps every tile (dense attention), shape [1, 1, QB, KB]."""
        check_block_size("block_q", block_q)
        check_block_size("block_k", block_k)
        _check_length("q_len", q_len)
        _check_length("kv_len", kv_len)
        qb, kb = num_blocks(q_len, block_q), num_blocks(kv_len, block_k)
        # Its kv table is known without the sort kept_index_table does: every row keeps 0 .. KB-1.
        count = torch.full((1, 1, qb), kb, dtype=torch.int32, device=device)
        index = torch.arange(kb, dtype=torch.int32, device=device).expand(1, 1, qb, kb).contiguous()
        return cls.from_dense(torch.ones((1, 1, qb, kb), dtype=torch.bool, device=device), q_len, kv_len, block_q,
                              block_k, kv_table=(count, index))

    # ---------------------------------------------------------------- shape helpers
    @property
    def device(self) -> torch.device:
        return self.keep.device

    @property
    def num_q_blocks(self) -> int:
        return self.keep.shape[-2]

    @property
    def num_kv_blocks(self) -> int:
        return self.keep.shape[-1]

    def to_dense(self) -> torch.Tensor:
        """The bool block map, [B|1, H|1, QB, KB]."""
        return self.keep

    def to(self, device: torch.device | str) -> "SparseMask":
        """The same mask on another device."""
        return SparseMask(self.keep.to(device), self.q_len, self.kv_len, self.block_q, self.block_k)

    def _block_lengths(self) -> tuple[torch.Tensor, torch.Tensor]:
        """float64 [QB] and [KB]: tokens per query block and per key block (the last ones may be short)."""
        return (block_token_counts(self.q_len, self.block_q, self.device, torch.float64),
                block_token_counts(self.kv_len, self.block_k, self.device, torch.float64))

    def tile_areas(self) -> torch.Tensor:
        """float64 [QB, KB]: number of (query, key) pairs each tile covers (edge tiles are smaller)."""
        return torch.outer(*self._block_lengths())

    @property
    def sparsity_per_head(self) -> torch.Tensor:
        """float64 [B|1, H|1]: fraction of (query, key) pairs skipped, per batch entry and head (device work
        only: no host read)."""
        kept = torch.einsum("bhqk,q,k->bh", self.keep.to(torch.float64), *self._block_lengths())
        return 1.0 - kept / (float(self.q_len) * float(self.kv_len))

    @property
    def sparsity(self) -> float:
        """Fraction of (query-block, key-block) tiles skipped, weighted by tile area, over all heads."""
        return float(self.sparsity_per_head.mean())

    def check_compatible(self, batch: int, heads: int, q_len: int, kv_len: int,
                         device: torch.device) -> None:
        """Raise ``ValueError`` unless this mask fits attention inputs of the given sizes and device."""
        b, h = self.keep.shape[:2]
        if b not in (1, batch) or h not in (1, heads):
            raise ValueError(
                f"mask batch/head dims {(b, h)} do not broadcast to q's (B, H) = {(batch, heads)}"
            )
        if (q_len, kv_len) != (self.q_len, self.kv_len):
            raise ValueError(
                f"mask was made for q_len={self.q_len}, kv_len={self.kv_len}, "
                f"but q has {q_len} tokens and k/v have {kv_len}"
            )
        if self.device.type != device.type or (
            device.index is not None and self.device.index is not None and self.device.index != device.index
        ):
            raise ValueError(f"mask is on {self.device} but the attention inputs are on {device}")

    # ---------------------------------------------------------------- index tables
    def _table(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        if name not in self._tables:
            keep = self.keep if name == "kv" else self.keep.transpose(-1, -2)
            self._tables[name] = kept_index_table(keep)
        return self._tables[name]

    @property
    def max_kept_blocks(self) -> int:
        """The most key blocks any query block keeps: a host int, read from the device once per mask."""
        if "max_kept" not in self._tables:
            self._tables["max_kept"] = int(self.kv_count.max())
        return self._tables["max_kept"]

    @property
    def kv_count(self) -> torch.Tensor:
        """int32 [B', H', QB]: number of kept key blocks per query block."""
        return self._table("kv")[0]

    @property
    def kv_index(self) -> torch.Tensor:
        """int32 [B', H', QB, KB]: kept key-block indices per query block, ascending, padded."""
        return self._table("kv")[1]

    @property
    def q_count(self) -> torch.Tensor:
        """int32 [B', H', KB]: number of query blocks that keep each key block."""
        return self._table("q")[0]

    @property
    def q_index(self) -> torch.Tensor:
        """int32 [B', H', KB, QB]: query blocks that keep each key block, ascending, padded."""
        return self._table("q")[1]

    # ---------------------------------------------------------------- flex attention
    def to_flex(self):
        """The same mask as a ``torch.nn.attention.flex_attention.BlockMask``.

        Kept tiles are "full" blocks, so compiled FlexAttention evaluates no per-element mask on them;
        the mask function (which reads the block map) serves FlexAttention's eager path. FlexAttention
        itself bounds the last, short blocks. Built once per mask and cached.
        """
        if "flex" not in self._tables:
            self._tables["flex"] = self._build_flex()
        return self._tables["flex"]

    def _build_flex(self):
        from torch.nn.attention.flex_attention import BlockMask

        keep, block_q, block_k = self.keep, self.block_q, self.block_k
        per_batch, per_head = keep.shape[0] > 1, keep.shape[1] > 1

        def kept_tile(b, h, q_idx, kv_idx):
            return keep[b if per_batch else b * 0, h if per_head else h * 0, q_idx // block_q, kv_idx // block_k]

        return BlockMask.from_kv_blocks(
            torch.zeros_like(self.kv_count),
            torch.zeros_like(self.kv_index),
            full_kv_num_blocks=self.kv_count,
            full_kv_indices=self.kv_index,
            BLOCK_SIZE=(block_q, block_k),
            mask_mod=kept_tile,
            seq_lengths=(self.q_len, self.kv_len),
        )

    def __repr__(self) -> str:
        return (
            f"SparseMask(shape={tuple(self.keep.shape)}, q_len={self.q_len}, kv_len={self.kv_len}, "
            f"block_q={self.block_q}, block_k={self.block_k}, sparsity={self.sparsity:.4f}, "
            f"device={self.device})"
        )


def random_block_mask(batch: int, heads: int, q_len: int, kv_len: int, sparsity: float,
                      block_q: int = DEFAULT_BLOCK_Q, block_k: int = DEFAULT_BLOCK_K, keep_diagonal: bool = True,
                      generator: torch.Generator | None = None, device=None) -> SparseMask:
    """A random mask that keeps about ``1 - sparsity`` of the tiles of each row (benchmarks, tests).

    Each query-block row keeps ``max(1, round((1 - sparsity) * KB))`` key blocks chosen uniformly;
    with ``keep_diagonal`` the key block holding the row's first query token is always one of them.
    """
    for name, value in (("batch", batch), ("heads", heads), ("q_len", q_len), ("kv_len", kv_len)):
        _check_length(name, value)
    check_block_size("block_q", block_q)
    check_block_size("block_k", block_k)
    if not isinstance(sparsity, numbers.Real) or isinstance(sparsity, bool):
        raise TypeError(f"sparsity must be a number in [0, 1), got {sparsity!r}")
    if not 0.0 <= sparsity < 1.0:
        raise ValueError(f"sparsity must be in [0, 1), got {sparsity!r}")
    if not isinstance(keep_diagonal, bool):
        raise TypeError(f"keep_diagonal must be a bool, got {keep_diagonal!r}")
    qb, kb = num_blocks(q_len, block_q), num_blocks(kv_len, block_k)
    per_row = max(1, min(kb, int(round((1.0 - sparsity) * kb))))
    scores = torch.rand(batch, heads, qb, kb, generator=generator)
    if keep_diagonal:
        diag = torch.div(torch.arange(qb) * block_q, block_k, rounding_mode="floor").clamp_max(kb - 1)
        scores[:, :, torch.arange(qb), diag] = 2.0
    top = scores.topk(per_row, dim=-1).indices
    keep = torch.zeros(batch, heads, qb, kb, dtype=torch.bool)
    keep.scatter_(-1, top, True)
    return SparseMask(keep.to(device), q_len, kv_len, block_q, block_k)


def expand_block_mask(mask: SparseMask) -> torch.Tensor:
    """bool [B|1, H|1, N, M]: the token-level mask. Only for small sizes (tests, references)."""
    keep = mask.keep.repeat_interleave(mask.block_q, dim=-2)[..., : mask.q_len, :]
    return keep.repeat_interleave(mask.block_k, dim=-1)[..., : mask.kv_len]
