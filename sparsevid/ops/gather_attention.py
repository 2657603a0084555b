"""Block-sparse attention that computes only the kept tiles, in plain PyTorch: the fast path off CUDA.

For every query block the kept key/value blocks (the mask's index table) are gathered into one contiguous
slab ``[kept * block_k, D]`` and the softmax runs over that slab only, so work and memory follow the kept
tiles, not N * M. Query blocks (over all batch entries and heads) are sorted by their number of kept blocks
and processed in chunks of near-equal counts with batched matrix products: inside a chunk each query block
is padded to the chunk's largest count (the padded tiles bounded by ``_PADDING_SHARE`` and
``_FREE_PADDING_TILES``); the padding columns (and the columns past ``kv_len`` of a short last key block)
get a score of -inf. A chunk's tensors hold at most about ``_CHUNK_ELEMENTS`` elements each. The query
blocks are put in chunk order once (one copy, each chunk a slice of it) and the outputs written back once.
Query blocks that keep every key block are not gathered: they attend their heads' keys and values as they
are, the heads with equally many such blocks in one call (so a fully kept mask costs what dense attention
costs). On the CPU each chunk runs PyTorch's fused attention kernel (the one ``scaled_dot_product_attention``
uses); elsewhere batched matrix products and an explicit softmax.

The backward pass recomputes each chunk's scores from q, k, v and the saved row log-sum-exp (nothing of
size N * M, and no probabilities, are kept between the passes) and scatters the key/value gradients back
with ``index_add_``.

Computation runs in float32 (float64 for float64 inputs); outputs are cast back to the input dtype.
"""
from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .mask import SparseMask, num_blocks
from .pooling import block_token_counts
from .validation import grad_requested

# Elements of the largest tensor a chunk of query blocks materialises (its scores [r, bq, kept * bk] or its
# gathered keys [r, kept * bk, D]): 2**22 (16 MiB in float32). Few, large chunks suit a shared CPU, where each
# chunk's parallel regions wait for descheduled threads (benchmarks/NOTES.md, "CPU attention").
_CHUNK_ELEMENTS = 1 << 22
# A chunk pads at most _PADDING_SHARE-th of its kept tiles, or _FREE_PADDING_TILES tiles where that is more:
# a bound on the padded work that still keeps chunks few (every chunk is a few parallel regions, and at high
# sparsity a tile costs little next to a parallel region).
_PADDING_SHARE = 8
_FREE_PADDING_TILES = 32


@dataclass(frozen=True)
class _Chunk:
    """One batch of query blocks that keep ``1 <= count <= slots`` key blocks each.

    start, stop: the chunk's slice of the plan's ``rows``; rows: int64 [r] its query-block rows (flattened
    over B, H, QB); blocks: int64 [r * slots] flattened key blocks (over B, H, KB) to gather, row-major; bias:
    float [r, 1, slots * block_k] with 0 on real columns and -inf on padding, or None when every column is
    real; kept: int64 [r, slots] each slot's key-block index within its row's head (for tile masses).
    """

    start: int
    stop: int
    rows: torch.Tensor
    blocks: torch.Tensor
    bias: torch.Tensor | None
    kept: torch.Tensor
    slots: int


@dataclass(frozen=True)
class _WholeRows:
    """Query blocks that keep every key block, of the heads that have the same number ``w`` of them.

    heads: int64 [g] the heads (flattened over B, H), ascending; rows: int64 [g * w] their query-block rows
    (flattened over B, H, QB), head by head, ascending. Each head's rows attend its keys and values as they
    are, all heads in one call (PyTorch's fused CPU backward runs one thread per head: one call per head
    would run on one core).
    """

    heads: torch.Tensor
    rows: torch.Tensor


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
    rows: torch.Tensor  # int64 [A]: the query-block rows of all chunks, in chunk order
    chunks: tuple[_Chunk, ...]
    whole_rows: tuple[_WholeRows, ...]
    empty_rows: torch.Tensor  # int64 [e]: query-block rows that keep no key block

    @property
    def q_blocks(self) -> int:
        return num_blocks(self.q_len, self.block_q)

    @property
    def kv_blocks(self) -> int:
        return num_blocks(self.kv_len, self.block_k)


def _make_plan(mask: SparseMask, batch: int, heads: int, head_dim: int, scale: float, compute: torch.dtype,
               device: torch.device, whole_rows: bool = True) -> _Plan:
    """Chunks of the query blocks by their kept count; with ``whole_rows`` the query blocks that keep every
    key block are set apart per head (:class:`_WholeRows`), else they form chunks like the others."""
    qb, kb, block_q, block_k = mask.num_q_blocks, mask.num_kv_blocks, mask.block_q, mask.block_k
    count = mask.kv_count.expand(batch, heads, qb).reshape(-1)
    index = mask.kv_index.expand(batch, heads, qb, kb).reshape(-1, kb)
    head_offset = torch.arange(batch * heads, device=device).repeat_interleave(qb) * kb
    sorted_count, order = torch.sort(count, stable=True)  # stable: equal counts stay in row order
    counts = sorted_count.tolist()
    first = bisect.bisect_right(counts, 0)
    end = bisect.bisect_left(counts, kb) if whole_rows else len(counts)
    empty_rows, begin, chunks = order[:first], first, []
    while first < end:
        stop = _chunk_end(counts, first, end, _CHUNK_ELEMENTS // (max(block_q, head_dim) * block_k))
        rows, slots = order[first:stop], counts[stop - 1]
        kept = index[rows, :slots].long()
        bias = _padding_bias(kept, count[rows], slots, mask.kv_len, block_k, compute)
        chunks.append(_Chunk(first - begin, stop - begin, rows, (kept + head_offset[rows, None]).reshape(-1),
                             bias, kept, slots))
        first = stop
    whole = order[end:]
    head_of_whole = whole // qb
    head_ids, per_head = torch.unique_consecutive(head_of_whole, return_counts=True)
    groups = []
    for w in sorted(set(per_head.tolist())):
        heads_w = head_ids[per_head == w]
        groups.append(_WholeRows(heads_w, whole[torch.isin(head_of_whole, heads_w)]))
    return _Plan(batch, heads, mask.q_len, mask.kv_len, block_q, block_k, scale, compute, order[begin:end],
                 tuple(chunks), tuple(groups), empty_rows)


def _chunk_end(counts: list[int], first: int, end: int, budget_tiles: int) -> int:
    """The end of the chunk that starts at ``first`` in the ascending ``counts[:end]``: as long as its padded
    tiles fit ``budget_tiles`` (at least one row) and its padding the bounds above."""
    kept, stop = 0, first
    while stop < end:
        rows, slots = stop - first + 1, counts[stop]
        padding = rows * slots - kept - slots
        if stop > first and (rows * slots > budget_tiles
                             or padding > max((kept + slots) // _PADDING_SHARE, _FREE_PADDING_TILES)):
            break
        kept, stop = kept + slots, stop + 1
    return stop


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
    padded = num_blocks(length, block) * block
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


def _per_head(blocks: torch.Tensor, plan: _Plan) -> torch.Tensor:
    """The keys or values (or their gradients) ``blocks`` [B * H * KB, bk, D] as a view [B * H, kv_len, D]
    (the zero padding of a short last block left out)."""
    return blocks.view(plan.batch * plan.heads, plan.kv_blocks * plan.block_k, -1)[:, :plan.kv_len]


def _heads(blocks: torch.Tensor, whole: _WholeRows, plan: _Plan) -> torch.Tensor:
    """[g, kv_len, D]: the keys or values of ``whole``'s heads (a view when they are all heads)."""
    per_head = _per_head(blocks, plan)
    return per_head if len(whole.heads) == len(per_head) else per_head.index_select(0, whole.heads)


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


def _without_autocast(compute):
    """Run ``compute(q_blocks, ...)`` with autocast off on q_blocks' device: its products stay in the compute
    dtype (float32 or float64) also when the caller runs under ``torch.autocast``."""
    @functools.wraps(compute)
    def run(*args, **kwargs):
        with torch.autocast(args[0].device.type, enabled=False):
            return compute(*args, **kwargs)
    return run


@_without_autocast
def _forward(q_blocks, k_blocks, v_blocks, plan: _Plan, with_tile_mass: bool = False):
    """out [R, bq, D] and lse [R, bq] in the compute dtype (R = B * H * QB; rows without kept tiles: 0 and
    -inf), and with ``with_tile_mass`` the tile masses float32 [B, H, QB, KB]."""
    out = _alloc(q_blocks.shape, q_blocks).index_fill_(0, plan.empty_rows, 0.0)
    lse = _alloc(q_blocks.shape[:2], q_blocks).index_fill_(0, plan.empty_rows, float("-inf"))
    mass = q_blocks.new_zeros((q_blocks.shape[0], plan.kv_blocks)) if with_tile_mass else None
    k_buffer, v_buffer = _gather_buffer(k_blocks, plan), _gather_buffer(v_blocks, plan)
    q_sorted, outs, lses = q_blocks.index_select(0, plan.rows), [], []
    for chunk in plan.chunks:
        q, k = q_sorted[chunk.start:chunk.stop], _gather(k_blocks, chunk, plan, k_buffer)
        chunk_out, chunk_lse = _attend(q, k, _gather(v_blocks, chunk, plan, v_buffer), chunk.bias, plan.scale)
        outs.append(chunk_out)
        lses.append(chunk_lse)
        if mass is not None:
            probs = _scores(q, k, chunk.bias, plan.scale).sub_(chunk_lse[:, :, None]).exp_()
            mass.index_copy_(0, chunk.rows, _chunk_tile_mass(probs, chunk, plan))
    if plan.chunks:
        out.index_copy_(0, plan.rows, torch.cat(outs))
        lse.index_copy_(0, plan.rows, torch.cat(lses))
    for whole in plan.whole_rows:
        q = q_blocks.index_select(0, whole.rows).view(len(whole.heads), -1, q_blocks.shape[-1])
        whole_out, whole_lse = _attend(q, _heads(k_blocks, whole, plan), _heads(v_blocks, whole, plan), None,
                                       plan.scale)
        out.index_copy_(0, whole.rows, whole_out.view(-1, plan.block_q, whole_out.shape[-1]))
        lse.index_copy_(0, whole.rows, whole_lse.view(-1, plan.block_q))
    if mass is not None:
        mass = mass.float().view(plan.batch, plan.heads, plan.q_blocks, plan.kv_blocks)
    return out, lse, mass


def _chunk_tile_mass(probs: torch.Tensor, chunk: _Chunk, plan: _Plan) -> torch.Tensor:
    """[r, KB]: each row block's mean probability per key block, from probs [r, bq, slots * bk] (query rows
    past q_len, the zero padding of a short last block, are left out of the mean)."""
    r = len(chunk.rows)
    per_slot = probs.view(r, plan.block_q, chunk.slots, plan.block_k).sum(-1)
    real_rows = block_token_counts(plan.q_len, plan.block_q, probs.device, torch.int64)[chunk.rows % plan.q_blocks]
    row_weight = (torch.arange(plan.block_q, device=probs.device) < real_rows[:, None]).to(probs.dtype)
    per_slot = (per_slot * row_weight[:, :, None]).sum(1) / real_rows[:, None].to(probs.dtype)
    # Padding slots repeat a kept block with probability 0: adding them changes nothing.
    return probs.new_zeros((r, plan.kv_blocks)).scatter_add_(1, chunk.kept, per_slot)


@_without_autocast
def _backward(grad_out, grad_lse, q_blocks, k_blocks, v_blocks, out, lse, plan: _Plan):
    """dq [R, bq, D] and dk, dv [B * H * KB, bk, D] in the compute dtype, chunk by chunk."""
    dq = _alloc(q_blocks.shape, q_blocks).index_fill_(0, plan.empty_rows, 0.0)
    dk = torch.zeros_like(k_blocks)
    dv = torch.zeros_like(v_blocks)
    k_buffer, v_buffer = _gather_buffer(k_blocks, plan), _gather_buffer(v_blocks, plan)
    rows = plan.rows
    d_out_s, q_s, out_s, lse_s = (t.index_select(0, rows) for t in (grad_out, q_blocks, out, lse))
    d_lse_s = None if grad_lse is None else grad_lse.index_select(0, rows)
    dqs = []
    for chunk in plan.chunks:
        part = slice(chunk.start, chunk.stop)
        dq_c, dk_c, dv_c = _attend_backward(
            d_out_s[part], None if d_lse_s is None else d_lse_s[part], q_s[part],
            _gather(k_blocks, chunk, plan, k_buffer), _gather(v_blocks, chunk, plan, v_buffer), chunk.bias,
            out_s[part], lse_s[part], plan.scale)
        dqs.append(dq_c)
        # Padding slots repeat a kept block and get zero gradient: adding them changes nothing.
        dk.index_add_(0, chunk.blocks, dk_c.reshape(-1, plan.block_k, dk_c.shape[-1]))
        dv.index_add_(0, chunk.blocks, dv_c.reshape(-1, plan.block_k, dv_c.shape[-1]))
    if plan.chunks:
        dq.index_copy_(0, rows, torch.cat(dqs))
    for whole in plan.whole_rows:
        rows, g, d = whole.rows, len(whole.heads), q_blocks.shape[-1]
        d_lse = None if grad_lse is None else grad_lse.index_select(0, rows).view(g, -1)
        dq_w, dk_w, dv_w = _attend_backward(
            grad_out.index_select(0, rows).view(g, -1, d), d_lse, q_blocks.index_select(0, rows).view(g, -1, d),
            _heads(k_blocks, whole, plan), _heads(v_blocks, whole, plan), None,
            out.index_select(0, rows).view(g, -1, d), lse.index_select(0, rows).view(g, -1), plan.scale)
        dq.index_copy_(0, rows, dq_w.view(-1, plan.block_q, d))
        _per_head(dk, plan).index_add_(0, whole.heads, dk_w)
        _per_head(dv, plan).index_add_(0, whole.heads, dv_w)
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
        return _blocks_backward(grad_out, grad_lse, q_blocks, k_blocks, v_blocks, out, lse, ctx.plan, ctx.dtype) + (
            None,)


def _blocks_backward(grad_out, grad_lse, q_blocks, k_blocks, v_blocks, out, lse, plan: _Plan,
                     dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv in ``dtype`` ([B, H, N|M, D]) from the output gradients (either may be None) and the forward's
    block-layout inputs and results."""
    if grad_out is None:
        grad_out_blocks = torch.zeros_like(out)
    else:
        grad_out_blocks = _to_blocks(grad_out, plan.block_q, plan.compute)
    if grad_lse is not None:
        grad_lse = F.pad(grad_lse.to(plan.compute), (0, plan.q_blocks * plan.block_q - plan.q_len))
        grad_lse = grad_lse.reshape(-1, plan.block_q)
    dq, dk, dv = _backward(grad_out_blocks, grad_lse, q_blocks, k_blocks, v_blocks, out, lse, plan)
    return (_from_blocks(dq, plan, plan.q_len, dtype), _from_blocks(dk, plan, plan.kv_len, dtype),
            _from_blocks(dv, plan, plan.kv_len, dtype))


def _lse_from_blocks(lse: torch.Tensor, plan: _Plan) -> torch.Tensor:
    """[R, bq] -> [B, H, N], float32 (float64 for float64 inputs)."""
    dtype = torch.float64 if plan.compute == torch.float64 else torch.float32
    return lse.reshape(plan.batch, plan.heads, -1)[:, :, :plan.q_len].to(dtype).contiguous()


def gather_block_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: SparseMask,
                                  scale: float, return_tile_mass: bool = False) -> tuple[torch.Tensor, ...]:
    """Block-sparse attention over the kept tiles only (see the module docstring).

    q: [B, H, N, D], k/v: [B, H, M, D] (any strides, any floating dtype); mask fits (N, M) and broadcasts
    over B and H. Returns out [B, H, N, D] (q's dtype) and lse [B, H, N] (float32; float64 for float64 q);
    rows with no kept tile give zeros and -inf. Differentiable in q, k, v. With ``return_tile_mass``
    (inference only) also the exact tile masses float32 [B, H, QB, KB].
    Under ``torch.compile`` it is the custom op ``torch.ops.sparsevid.gather_block_sparse_attn`` (it reads the
    mask's block counts on the host, which a traced graph cannot); the tile masses run eagerly.
    """
    if torch.compiler.is_compiling() and not return_tile_mass:
        return tuple(_gather_attn(q, k, v, mask.keep, mask.q_len, mask.kv_len, mask.block_q, mask.block_k, scale))
    return _eager_gather(q, k, v, mask, scale, return_tile_mass)


@torch.compiler.disable
def _eager_gather(q, k, v, mask: SparseMask, scale: float, return_tile_mass: bool) -> tuple[torch.Tensor, ...]:
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    plan = _make_plan(mask, q.shape[0], q.shape[1], q.shape[3], scale, compute, q.device,
                      whole_rows=not return_tile_mass)
    if return_tile_mass or not grad_requested(q, k, v):
        with torch.no_grad():
            q_blocks = _to_blocks(q, plan.block_q, compute)
            out, lse, mass = _forward(q_blocks, _to_blocks(k, plan.block_k, compute),
                                      _to_blocks(v, plan.block_k, compute), plan, return_tile_mass)
        result = (_from_blocks(out, plan, plan.q_len, q.dtype), _lse_from_blocks(lse, plan))
        return result + ((mass,) if return_tile_mass else ())
    return _GatherAttention.apply(q, k, v, plan)


# --------------------------------------------------------------------------- the op torch.compile traces

@torch.library.custom_op("sparsevid::gather_block_sparse_attn", mutates_args=())
def _gather_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor, q_len: int, kv_len: int,
                 block_q: int, block_k: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    mask = SparseMask.from_dense(keep, q_len, kv_len, block_q, block_k)
    out, lse = _eager_gather(q, k, v, mask, scale, False)
    return out.contiguous(), lse.contiguous()


@_gather_attn.register_fake
def _(q, k, v, keep, q_len, kv_len, block_q, block_k, scale):
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=dtype)


@torch.library.custom_op("sparsevid::gather_block_sparse_attn_backward", mutates_args=())
def _gather_attn_backward(grad_out: torch.Tensor | None, grad_lse: torch.Tensor | None, q: torch.Tensor,
                          k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor, q_len: int, kv_len: int,
                          block_q: int, block_k: int,
                          scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Recomputes the forward in block layout (as activation checkpointing would), then its backward."""
    mask = SparseMask.from_dense(keep, q_len, kv_len, block_q, block_k)
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    plan = _make_plan(mask, q.shape[0], q.shape[1], q.shape[3], scale, compute, q.device)
    blocks = (_to_blocks(q, block_q, compute), _to_blocks(k, block_k, compute), _to_blocks(v, block_k, compute))
    out, lse, _ = _forward(*blocks, plan)
    return tuple(g.contiguous() for g in _blocks_backward(grad_out, grad_lse, *blocks, out, lse, plan, q.dtype))


@_gather_attn_backward.register_fake
def _(grad_out, grad_lse, q, k, v, keep, q_len, kv_len, block_q, block_k, scale):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_gather_context(ctx, inputs, output):
    q, k, v, keep, q_len, kv_len, block_q, block_k, scale = inputs
    ctx.save_for_backward(q, k, v, keep)
    ctx.sizes = (q_len, kv_len, block_q, block_k, scale)


def _gather_backward(ctx, grad_out, grad_lse):
    q, k, v, keep = ctx.saved_tensors
    dq, dk, dv = _gather_attn_backward(grad_out, grad_lse, q, k, v, keep, *ctx.sizes)
    return dq, dk, dv, None, None, None, None, None, None


_gather_attn.register_autograd(_gather_backward, setup_context=_setup_gather_context)
