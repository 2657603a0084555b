"""Block-sparse attention that computes only the kept tiles, in plain PyTorch: the fast path off CUDA.

For every query block the kept key/value blocks (the mask's index table) are gathered into one contiguous
slab ``[kept * block_k, D]`` and the softmax runs over that slab only, so work and memory follow the kept
tiles, not N * M. Query blocks (over all batch entries and heads) are sorted by their number of kept blocks
and processed in chunks of similar counts with batched matrix products; inside a chunk each query block is
padded to the chunk's largest count, the padding columns (and the columns past ``kv_len`` of a short last
key block) get a score of -inf. A chunk's tensors hold at most about ``_CHUNK_ELEMENTS`` elements each. On
the CPU each chunk runs PyTorch's fused attention kernel (the one ``scaled_dot_product_attention`` uses);
elsewhere batched matrix products and an explicit softmax.

The backward pass recomputes each chunk's scores from q, k, v and the saved row log-sum-exp (nothing of
size N * M, and no probabilities, are kept between the passes) and scatters the key/value gradients back
with ``index_add_``.

Computation runs in float32 (float64 for float64 inputs); outputs are cast back to the input dtype.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .mask import SparseMask
from .validation import grad_requested

# Elements of the largest tensor a chunk of query blocks materialises (its scores [r, bq, kept * bk] or its
# gathered keys [r, kept * bk, D]). At the demo's shape on a 2-core CPU, 2**22 (16 MiB in float32) was within
# 10% of the fastest (2**20) when the machine was idle and twice as fast as 2**20 when it was shared (fewer
# chunks, fewer parallel regions waiting for a descheduled thread); see benchmarks/NOTES.md.
_CHUNK_ELEMENTS = 1 << 22


@dataclass(frozen=True)
class _Chunk:
    """One batch of query blocks that keep ``1 <= count <= slots`` key blocks each.

    rows: int64 [r] query-block rows (flattened over B, H, QB); blocks: int64 [r * slots] flattened key
    blocks (over B, H, KB) to gather, row-major; bias: float [r, 1, slots * block_k] with 0 on real columns
    and -inf on padding, or None when every column is real; kept: int64 [r, slots] each slot's key-block
    index within its row's head (for tile masses).
    """

    rows: torch.Tensor
    blocks: torch.Tensor
    bias: torch.Tensor | None
    kept: torch.Tensor
    slots: int


@dataclass(frozen=True)
class _Plan:
    """How one call walks the mask: sizes and the chunks of non-empty query blocks."""

    batch: int
    heads: int
    q_len: int
    kv_len: int
    block_q: int
    block_k: int
    scale: float
    compute: torch.dtype
    chunks: tuple[_Chunk, ...]
    empty_rows: torch.Tensor  # int64 [e]: query-block rows that keep no key block

    @property
    def q_blocks(self) -> int:
        return -(-self.q_len // self.block_q)

    @property
    def kv_blocks(self) -> int:
        return -(-self.kv_len // self.block_k)


def _make_plan(mask: SparseMask, batch: int, heads: int, head_dim: int, scale: float, compute: torch.dtype,
               device: torch.device) -> _Plan:
    qb, kb, block_q, block_k = mask.num_q_blocks, mask.num_kv_blocks, mask.block_q, mask.block_k
    count = mask.kv_count.expand(batch, heads, qb).reshape(-1).long()
    index = mask.kv_index.expand(batch, heads, qb, kb).reshape(-1, kb)
    head_offset = torch.arange(batch * heads, device=device).repeat_interleave(qb) * kb
    sorted_count, order = torch.sort(count, stable=True)
    counts = sorted_count.tolist()
    first = next((i for i, c in enumerate(counts) if c > 0), len(counts))
    empty_rows, chunks = order[:first], []
    while first < len(counts):
        last = len(counts)
        while True:  # shrink until the chunk (padded to its largest count) fits the budget
            fit = max(1, _CHUNK_ELEMENTS // (max(block_q, head_dim) * block_k * counts[last - 1]))
            if last - first <= fit:
                break
            last = first + fit
        rows = order[first:last]
        slots = counts[last - 1]
        kept = index[rows, :slots].long()
        chunks.append(_Chunk(rows, (kept + head_offset[rows, None]).reshape(-1),
                             _padding_bias(kept, count[rows], slots, mask.kv_len, block_k, compute), kept, slots))
        first = last
    return _Plan(batch, heads, mask.q_len, mask.kv_len, block_q, block_k, scale, compute, tuple(chunks), empty_rows)


def _padding_bias(kept: torch.Tensor, count: torch.Tensor, slots: int, kv_len: int, block_k: int,
                  compute: torch.dtype) -> torch.Tensor | None:
    """float [r, 1, slots * block_k]: 0 where a gathered column is a real key, -inf on slots past a row's
    count and on columns past ``kv_len``; None when all columns are real."""
    slot_used = torch.arange(slots, device=kept.device) < count[:, None]
    columns = kept[:, :, None] * block_k + torch.arange(block_k, device=kept.device)
    real = (slot_used[:, :, None] & (columns < kv_len)).reshape(len(kept), 1, slots * block_k)
    if bool(real.all()):
        return None
    zero = torch.zeros((), dtype=compute, device=kept.device)
    return torch.where(real, zero, torch.full_like(zero, float("-inf")))


def _to_blocks(t: torch.Tensor, block: int, compute: torch.dtype) -> torch.Tensor:
    """[B, H, L, D] -> contiguous [B * H * ceil(L / block), block, D] in ``compute``, zero-padded past L."""
    b, h, length, d = t.shape
    padded = -(-length // block) * block
    t = t.to(compute)
    if padded != length:
        t = F.pad(t, (0, 0, 0, padded - length))
    return t.reshape(b * h * (padded // block), block, d)


def _from_blocks(t: torch.Tensor, plan: _Plan, length: int, dtype: torch.dtype) -> torch.Tensor:
    """[B * H * nblocks, block, D] -> [B, H, length, D] in ``dtype``."""
    out = t.reshape(plan.batch, plan.heads, -1, t.shape[-1])[:, :, :length]
    return out.to(dtype).contiguous()


def _alloc(shape, like: torch.Tensor) -> torch.Tensor:
    """An uninitialised tensor like ``like`` (the outputs every element of which the passes write)."""
    return like.new_empty(shape)


def _gather(blocks: torch.Tensor, chunk: _Chunk, plan: _Plan, buffer: torch.Tensor) -> torch.Tensor:
    """The chunk's kept key (or value) blocks of ``blocks`` [B * H * KB, bk, D] as [r, slots * bk, D], copied
    into ``buffer`` (one allocation reused by every chunk: fresh large tensors cost page faults)."""
    gathered = torch.index_select(blocks, 0, chunk.blocks, out=buffer[:len(chunk.blocks)])
    return gathered.view(len(chunk.rows), chunk.slots * plan.block_k, -1)


def _gather_buffer(blocks: torch.Tensor, plan: _Plan) -> torch.Tensor:
    """Room for the largest chunk's gathered blocks, like ``blocks`` [*, bk, D]."""
    return blocks.new_empty((max((len(c.blocks) for c in plan.chunks), default=0),) + blocks.shape[1:])


def _fused_kernel_runs_on(t: torch.Tensor) -> bool:
    """Whether PyTorch's fused CPU attention kernel (the one ``scaled_dot_product_attention`` runs on the
    CPU, which also returns the log-sum-exp) serves tensors like t; elsewhere plain matrix products do."""
    return t.device.type == "cpu"


def _scores(q: torch.Tensor, k: torch.Tensor, bias: torch.Tensor | None, scale: float) -> torch.Tensor:
    """Scaled scores [r, bq, c] of q [r, bq, D] against k [r, c, D], plus the padding bias [r, 1, c]."""
    if bias is None:
        return torch.bmm(q, k.transpose(1, 2)).mul_(scale)
    return torch.baddbmm(bias, q, k.transpose(1, 2), alpha=scale)


def _attend(q, k, v, bias, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of q [r, bq, D] over k, v [r, c, D] with the padding bias [r, 1, c] (or None):
    out [r, bq, D] and lse [r, bq] in q's dtype. Every row has at least one finite bias entry."""
    if _fused_kernel_runs_on(q):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q[:, None], k[:, None], v[:, None], attn_mask=None if bias is None else bias[:, None], scale=scale)
        return out[:, 0], lse[:, 0].to(q.dtype)
    scores = _scores(q, k, bias, scale)
    row_max = scores.amax(dim=-1, keepdim=True)
    weights = scores.sub_(row_max).exp_()
    total = weights.sum(dim=-1, keepdim=True)
    return torch.bmm(weights, v).div_(total), (row_max + total.log()).squeeze(-1)


def _attend_backward(d_out, d_lse, q, k, v, bias, out, lse, scale: float):
    """Gradients dq [r, bq, D], dk, dv [r, c, D] of :func:`_attend` given d_out [r, bq, D] and d_lse [r, bq]
    (or None), from its inputs and its outputs out, lse."""
    if d_lse is None and _fused_kernel_runs_on(q):
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            d_out[:, None], q[:, None], k[:, None], v[:, None], out[:, None], lse[:, None].to(out.dtype), 0.0,
            False, attn_mask=None if bias is None else bias[:, None], scale=scale)
        return dq[:, 0], dk[:, 0], dv[:, 0]
    probs = _scores(q, k, bias, scale).sub_(lse[:, :, None]).exp_()
    # d lse / d score = p, so an lse gradient enters as a shift of the row term sum(d_out * out).
    shift = (d_out * out).sum(-1) if d_lse is None else (d_out * out).sum(-1) - d_lse
    dv = torch.bmm(probs.transpose(1, 2), d_out)
    d_scores = torch.bmm(d_out, v.transpose(1, 2)).sub_(shift[:, :, None]).mul_(probs).mul_(scale)
    return torch.bmm(d_scores, k), torch.bmm(d_scores.transpose(1, 2), q), dv


def _forward(q_blocks, k_blocks, v_blocks, plan: _Plan, with_tile_mass: bool = False):
    """out [R, bq, D] and lse [R, bq] in the compute dtype (R = B * H * QB; rows without kept tiles: 0 and
    -inf), and with ``with_tile_mass`` the tile masses float32 [B, H, QB, KB]."""
    out = _alloc(q_blocks.shape, q_blocks).index_fill_(0, plan.empty_rows, 0.0)
    lse = _alloc(q_blocks.shape[:2], q_blocks).index_fill_(0, plan.empty_rows, float("-inf"))
    mass = q_blocks.new_zeros((q_blocks.shape[0], plan.kv_blocks)) if with_tile_mass else None
    k_buffer, v_buffer = _gather_buffer(k_blocks, plan), _gather_buffer(v_blocks, plan)
    for chunk in plan.chunks:
        q, k = q_blocks.index_select(0, chunk.rows), _gather(k_blocks, chunk, plan, k_buffer)
        chunk_out, chunk_lse = _attend(q, k, _gather(v_blocks, chunk, plan, v_buffer), chunk.bias, plan.scale)
        out.index_copy_(0, chunk.rows, chunk_out)
        lse.index_copy_(0, chunk.rows, chunk_lse)
        if mass is not None:
            probs = _scores(q, k, chunk.bias, plan.scale).sub_(chunk_lse[:, :, None]).exp_()
            mass.index_copy_(0, chunk.rows, _chunk_tile_mass(probs, chunk, plan))
    if mass is not None:
        mass = mass.float().view(plan.batch, plan.heads, plan.q_blocks, plan.kv_blocks)
    return out, lse, mass


def _chunk_tile_mass(probs: torch.Tensor, chunk: _Chunk, plan: _Plan) -> torch.Tensor:
    """[r, KB]: each row block's mean probability per key block, from probs [r, bq, slots * bk] (query rows
    past q_len, the zero padding of a short last block, are left out of the mean)."""
    r = len(chunk.rows)
    per_slot = probs.view(r, plan.block_q, chunk.slots, plan.block_k).sum(-1)
    last_rows = plan.q_len - (plan.q_blocks - 1) * plan.block_q
    real_rows = torch.where(chunk.rows % plan.q_blocks == plan.q_blocks - 1, last_rows, plan.block_q)
    row_weight = (torch.arange(plan.block_q, device=probs.device) < real_rows[:, None]).to(probs.dtype)
    per_slot = (per_slot * row_weight[:, :, None]).sum(1) / real_rows[:, None].to(probs.dtype)
    # Padding slots repeat a kept block with probability 0: adding them changes nothing.
    return probs.new_zeros((r, plan.kv_blocks)).scatter_add_(1, chunk.kept, per_slot)


def _backward(grad_out, grad_lse, q_blocks, k_blocks, v_blocks, out, lse, plan: _Plan):
    """dq [R, bq, D] and dk, dv [B * H * KB, bk, D] in the compute dtype, chunk by chunk."""
    dq = _alloc(q_blocks.shape, q_blocks).index_fill_(0, plan.empty_rows, 0.0)
    dk = torch.zeros_like(k_blocks)
    dv = torch.zeros_like(v_blocks)
    k_buffer, v_buffer = _gather_buffer(k_blocks, plan), _gather_buffer(v_blocks, plan)
    for chunk in plan.chunks:
        rows = chunk.rows
        d_lse = None if grad_lse is None else grad_lse.index_select(0, rows)
        dq_c, dk_c, dv_c = _attend_backward(
            grad_out.index_select(0, rows), d_lse, q_blocks.index_select(0, rows),
            _gather(k_blocks, chunk, plan, k_buffer), _gather(v_blocks, chunk, plan, v_buffer), chunk.bias,
            out.index_select(0, rows), lse.index_select(0, rows), plan.scale)
        dq.index_copy_(0, rows, dq_c)
        # Padding slots repeat a kept block and get zero gradient: adding them changes nothing.
        dk.index_add_(0, chunk.blocks, dk_c.reshape(-1, plan.block_k, dk_c.shape[-1]))
        dv.index_add_(0, chunk.blocks, dv_c.reshape(-1, plan.block_k, dv_c.shape[-1]))
    return dq, dk, dv


class _GatherAttention(torch.autograd.Function):
    """q, k, v [B, H, T, D] -> out [B, H, N, D] (q's dtype), lse [B, H, N]; backward by recomputation."""

    @staticmethod
    def forward(ctx, q, k, v, plan: _Plan):
        q_blocks = _to_blocks(q, plan.block_q, plan.compute)
        k_blocks = _to_blocks(k, plan.block_k, plan.compute)
        v_blocks = _to_blocks(v, plan.block_k, plan.compute)
        out, lse, _ = _forward(q_blocks, k_blocks, v_blocks, plan)
        ctx.save_for_backward(q_blocks, k_blocks, v_blocks, out, lse)
        ctx.plan, ctx.dtype = plan, q.dtype
        ctx.set_materialize_grads(False)
        return _from_blocks(out, plan, plan.q_len, q.dtype), _lse_from_blocks(lse, plan)

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q_blocks, k_blocks, v_blocks, out, lse = ctx.saved_tensors
        plan = ctx.plan
        if grad_out is None:
            grad_out_blocks = torch.zeros_like(out)
        else:
            grad_out_blocks = _to_blocks(grad_out, plan.block_q, plan.compute)
        if grad_lse is not None:
            grad_lse = F.pad(grad_lse.to(plan.compute), (0, plan.q_blocks * plan.block_q - plan.q_len))
            grad_lse = grad_lse.reshape(-1, plan.block_q)
        dq, dk, dv = _backward(grad_out_blocks, grad_lse, q_blocks, k_blocks, v_blocks, out, lse, plan)
        return (_from_blocks(dq, plan, plan.q_len, ctx.dtype), _from_blocks(dk, plan, plan.kv_len, ctx.dtype),
                _from_blocks(dv, plan, plan.kv_len, ctx.dtype), None)


def _lse_from_blocks(lse: torch.Tensor, plan: _Plan) -> torch.Tensor:
    """[R, bq] -> [B, H, N], float32 (float64 for float64 inputs)."""
    dtype = torch.float64 if plan.compute == torch.float64 else torch.float32
    return lse.reshape(plan.batch, plan.heads, -1)[:, :, :plan.q_len].to(dtype).contiguous()


@torch.compiler.disable
def gather_block_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: SparseMask,
                                  scale: float, return_tile_mass: bool = False) -> tuple[torch.Tensor, ...]:
    """Block-sparse attention over the kept tiles only (see the module docstring).

    q: [B, H, N, D], k/v: [B, H, M, D] (any strides, any floating dtype); mask fits (N, M) and broadcasts
    over B and H. Returns out [B, H, N, D] (q's dtype) and lse [B, H, N] (float32; float64 for float64 q);
    rows with no kept tile give zeros and -inf. Differentiable in q, k, v. With ``return_tile_mass``
    (inference only) also the exact tile masses float32 [B, H, QB, KB].
    ``torch.compile`` runs it eagerly (it reads the mask's block counts on the host).
    """
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    plan = _make_plan(mask, q.shape[0], q.shape[1], q.shape[3], scale, compute, q.device)
    if return_tile_mass or not grad_requested(q, k, v):
        with torch.no_grad():
            q_blocks = _to_blocks(q, plan.block_q, compute)
            out, lse, mass = _forward(q_blocks, _to_blocks(k, plan.block_k, compute),
                                      _to_blocks(v, plan.block_k, compute), plan, return_tile_mass)
        result = (_from_blocks(out, plan, plan.q_len, q.dtype), _lse_from_blocks(lse, plan))
        return result + ((mass,) if return_tile_mass else ())
    return _GatherAttention.apply(q, k, v, plan)
