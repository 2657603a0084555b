"""Triton kernels for mask prediction: block pooling, then pooled scores + selection + index table.

Two launches, no host synchronisation:

1. ``_pool_kernel`` reads Q and K once (one program per block and batch-head) and writes the fp32 block
   means (and, when asked, the block self-similarities, see ``pooling.py``).
2. ``_select_kernel`` (one program per ``ROWS`` query-block rows of one batch-head) computes the pooled
   logits ``q_bar @ k_bar^T`` with ``tl.dot`` over chunks of key blocks, parks them in a scratch row
   buffer (cache resident), and then, a few rows at a time with the whole row in registers, takes the
   softmax and finds the rule's threshold by bisection on the float's bit pattern (probabilities are
   non-negative, so their bit patterns order like their values): the largest ``tau`` with
   ``count(p >= tau) >= k_eff`` and ``mass(p >= tau) >= p_target`` (see ``selection.py``). The search
   stops as soon as one entry separates the bounds, which takes about log2(KB) steps. It then adds the
   option tiles and writes the keep row, the kept mass, and the compacted index table row (count and
   ascending indices by a prefix sum, padded with the last kept index, as ``kept_index_table`` lays it out).

Set ``TRITON_INTERPRET=1`` before importing this module to run the kernels on the CPU (tests).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .pooling import SIMILARITY_EPS

LOG2E = 1.4426950408889634

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

# Score rows are processed this many at a time, so a [SEL_ROWS, BLOCK_KB] tile stays near this size.
_SELECT_TILE_ELEMENTS = 4096
_ROWS = 16
_CHUNK = 32
_DOT_K = 32


def _configs(warps: tuple[int, ...]) -> list[triton.Config]:
    if _INTERPRET:
        return [triton.Config({}, num_warps=4, num_stages=1)]
    return [triton.Config({}, num_warps=w, num_stages=1) for w in warps]


@triton.jit
def _pool_block(p_x, stride_n, stride_d, length, block_id, p_mean, p_sim, eps,
                HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK: tl.constexpr, WITH_SIM: tl.constexpr):
    """Mean (and self-similarity) of one block of tokens of one head; fp32 accumulation."""
    o_t = block_id * BLOCK + tl.arange(0, BLOCK)
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < HEAD_DIM
    m_tile = (o_t < length)[:, None] & m_d[None, :]
    b_x = tl.load(p_x + o_t[:, None].to(tl.int64) * stride_n + o_d[None, :] * stride_d, mask=m_tile,
                  other=0.0).to(tl.float32)
    n_tokens = tl.minimum(length - block_id * BLOCK, BLOCK).to(tl.float32)
    b_mean = tl.sum(b_x, 0) / n_tokens
    tl.store(p_mean + o_d, b_mean, mask=m_d)
    if WITH_SIM:
        b_norm = tl.sqrt(tl.sum(b_x * b_x, 1))
        b_unit = tl.sum(b_x / tl.maximum(b_norm, eps)[:, None], 0) / n_tokens
        mean_norm = tl.sqrt(tl.sum(b_mean * b_mean, 0))
        tl.store(p_sim, tl.sum(b_mean * b_unit, 0) / tl.maximum(mean_norm, eps))


@triton.autotune(configs=_configs((4, 8, 16)), key=["HEAD_DIM", "BLOCK_Q", "BLOCK_K", "WITH_SIM"])
@triton.jit
def _pool_kernel(Q, K, PooledQ, PooledK, SimQ, SimK,
                 stride_qb, stride_qh, stride_qn, stride_qd,
                 stride_kb, stride_kh, stride_kn, stride_kd,
                 H, N, M, NUM_Q_BLOCKS, NUM_KV_BLOCKS, eps,
                 HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
                 WITH_SIM: tl.constexpr):
    """Programs [0, QB) pool query blocks, programs [QB, QB + KB) pool key blocks."""
    pid = tl.program_id(0)
    pid_bh = tl.program_id(1)
    i_b = (pid_bh // H).to(tl.int64)
    i_h = (pid_bh % H).to(tl.int64)
    if pid < NUM_Q_BLOCKS:
        row = pid_bh.to(tl.int64) * NUM_Q_BLOCKS + pid
        _pool_block(Q + i_b * stride_qb + i_h * stride_qh, stride_qn, stride_qd, N, pid,
                    PooledQ + row * HEAD_DIM, SimQ + row, eps, HEAD_DIM, BLOCK_D, BLOCK_Q, WITH_SIM)
    else:
        j = pid - NUM_Q_BLOCKS
        row = pid_bh.to(tl.int64) * NUM_KV_BLOCKS + j
        _pool_block(K + i_b * stride_kb + i_h * stride_kh, stride_kn, stride_kd, M, j,
                    PooledK + row * HEAD_DIM, SimK + row, eps, HEAD_DIM, BLOCK_D, BLOCK_K, WITH_SIM)


@triton.jit
def _per_head_value(scalar, p_values, i_h, PER_HEAD: tl.constexpr):
    if PER_HEAD:
        return tl.load(p_values + i_h)
    return scalar


@triton.jit
def _threshold_bits(b_p, m_valid, k_eff, target, num_valid):
    """int32 [R]: bit pattern of the largest tau with count(p >= tau) >= k_eff and mass(p >= tau) >= target.

    b_p: float32 [R, C], probabilities (padding and non-candidate entries hold -1); m_valid: bool [R, C] or
    [1, C], the candidates; num_valid: int32 [R], their number per row. The lower bound starts at the row's
    smallest candidate (where every candidate qualifies) and the upper bound just above the row maximum.
    """
    lo = tl.min(tl.where(m_valid, b_p, 2.0), 1).to(tl.int32, bitcast=True)
    hi = tl.max(b_p, 1).to(tl.int32, bitcast=True) + 1
    cnt_lo = num_valid
    cnt_hi = tl.zeros_like(lo)
    active = ((hi - lo) > 1) & ((cnt_lo - cnt_hi) > 1)
    while tl.max(active.to(tl.int32), 0) > 0:
        mid = lo + (hi - lo) // 2
        b_ge = b_p >= mid.to(tl.float32, bitcast=True)[:, None]
        cnt = tl.sum(b_ge.to(tl.int32), 1)
        mass = tl.sum(tl.where(b_ge, b_p, 0.0), 1)
        ok = (cnt >= k_eff) & (mass >= target)
        lo = tl.where(active & ok, mid, lo)
        cnt_lo = tl.where(active & ok, cnt, cnt_lo)
        hi = tl.where(active & ~ok, mid, hi)
        cnt_hi = tl.where(active & ~ok, cnt, cnt_hi)
        # Once a single entry separates the bounds, the kept set {p >= lo} is final.
        active = ((hi - lo) > 1) & ((cnt_lo - cnt_hi) > 1)
    return lo


_SELECT_TUNE_KEY = ["HEAD_DIM", "BLOCK_KB", "SEL_ROWS", "USE_TOPK", "USE_TOPP", "WITHIN"]


@triton.autotune(configs=_configs((4, 8)), key=_SELECT_TUNE_KEY)
@triton.jit
def _select_kernel(PooledQ, PooledK, SimQ, SimK, Scratch, Keep, Count, Index, KeptMass,
                   TopkPerHead, ToppPerHead, SimPerHead, Within,
                   topk, topp, sim_threshold, min_blocks, stride_wb, stride_wh, stride_wr,
                   H, N, M, NUM_Q_BLOCKS, NUM_KV_BLOCKS, scale_log2,
                   HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
                   ROWS: tl.constexpr, CHUNK: tl.constexpr, DOT_K: tl.constexpr, BLOCK_KB: tl.constexpr, SEL_ROWS: tl.constexpr,
                   USE_TOPK: tl.constexpr, USE_TOPP: tl.constexpr, TOPK_PER_HEAD: tl.constexpr,
                   TOPP_PER_HEAD: tl.constexpr, SIM_PER_HEAD: tl.constexpr, KEEP_SINK: tl.constexpr,
                   KEEP_DIAGONAL: tl.constexpr, WITH_SIM: tl.constexpr, WITHIN: tl.constexpr,
                   DOT_PRECISION: tl.constexpr):
    pid_r = tl.program_id(0)
    pid_bh = tl.program_id(1)
    i_h = pid_bh % H
    row0 = pid_r * ROWS
    q_rows = pid_bh.to(tl.int64) * NUM_Q_BLOCKS          # first row of this batch-head in [B*H*QB, ...]
    p_kbar = PooledK + pid_bh.to(tl.int64) * NUM_KV_BLOCKS * HEAD_DIM

    # Phase 1: base-2 logits of ROWS query blocks against every key block, into the scratch rows.
    # The head dim is walked in slices of DOT_K so that the fp32 operands stay small in registers.
    o_r = row0 + tl.arange(0, ROWS)
    m_r = o_r < NUM_Q_BLOCKS
    o_dk = tl.arange(0, DOT_K)
    p_qbar = PooledQ + (q_rows + o_r[:, None]) * HEAD_DIM + o_dk[None, :]
    p_scratch = Scratch + (q_rows + o_r[:, None]) * NUM_KV_BLOCKS
    for c in range(0, NUM_KV_BLOCKS, CHUNK):
        o_c = c + tl.arange(0, CHUNK)
        m_c = o_c < NUM_KV_BLOCKS
        p_kbar_c = p_kbar + o_c[:, None].to(tl.int64) * HEAD_DIM + o_dk[None, :]
        b_s = tl.zeros([ROWS, CHUNK], dtype=tl.float32)
        for d0 in tl.static_range(0, BLOCK_D, DOT_K):
            m_dk = (d0 + o_dk) < HEAD_DIM
            b_qbar = tl.load(p_qbar + d0, mask=m_r[:, None] & m_dk[None, :], other=0.0)
            b_kbar = tl.load(p_kbar_c + d0, mask=m_c[:, None] & m_dk[None, :], other=0.0)
            b_s = tl.dot(b_qbar, tl.trans(b_kbar), b_s, input_precision=DOT_PRECISION)
        tl.store(p_scratch + o_c[None, :], b_s * scale_log2, mask=m_r[:, None] & m_c[None, :])
    tl.debug_barrier()

    # Phase 2: softmax, threshold, options and outputs, SEL_ROWS rows at a time.
    k_eff = min_blocks
    if USE_TOPK:
        k_eff = tl.maximum(_per_head_value(topk, TopkPerHead, i_h, TOPK_PER_HEAD), k_eff)
    k_eff = tl.minimum(k_eff, NUM_KV_BLOCKS)
    target = 0.0
    if USE_TOPP:
        target = _per_head_value(topp, ToppPerHead, i_h, TOPP_PER_HEAD)
    o_k = tl.arange(0, BLOCK_KB)
    m_k = o_k < NUM_KV_BLOCKS
    if WITH_SIM:
        limit = _per_head_value(sim_threshold, SimPerHead, i_h, SIM_PER_HEAD)
        b_k_loose = tl.load(SimK + pid_bh.to(tl.int64) * NUM_KV_BLOCKS + o_k, mask=m_k, other=1.0) < limit
    for g in tl.static_range(0, ROWS, SEL_ROWS):
        o_s = row0 + g + tl.arange(0, SEL_ROWS)
        m_s = o_s < NUM_Q_BLOCKS
        m_tile = m_s[:, None] & m_k[None, :]
        o_tile = (q_rows + o_s[:, None]) * NUM_KV_BLOCKS + o_k[None, :]
        b_s = tl.load(Scratch + o_tile, mask=m_tile, other=float("-inf"))
        b_max = tl.max(b_s, 1)
        b_e = tl.math.exp2(b_s - tl.where(m_s, b_max, 0.0)[:, None])
        b_p = b_e / tl.where(m_s, tl.sum(b_e, 1), 1.0)[:, None]
        if WITHIN:
            # Only the tiles of the earlier mask are candidates; the softmax still spans the whole row.
            p_within = Within + (pid_bh // H).to(tl.int64) * stride_wb + i_h * stride_wh
            m_valid = tl.load(p_within + o_s[:, None] * stride_wr + o_k[None, :], mask=m_tile, other=0) != 0
        else:
            m_valid = m_k[None, :]
        num_valid = tl.sum(m_valid.to(tl.int32), 1) + tl.zeros([SEL_ROWS], dtype=tl.int32)
        b_p = tl.where(m_valid, b_p, -1.0)

        tau_bits = _threshold_bits(b_p, m_valid, k_eff, target, num_valid)
        tau = tau_bits.to(tl.float32, bitcast=True)
        if USE_TOPP:
            tau = tl.where(target >= 1.0, 0.0, tau)
        b_keep = b_p >= tau[:, None]
        if KEEP_SINK:
            b_keep = b_keep | (o_k == 0)[None, :]
        if KEEP_DIAGONAL:
            q_start = o_s * BLOCK_Q
            q_stop = tl.minimum(q_start + BLOCK_Q, N)
            k_start = o_k * BLOCK_K
            k_stop = tl.minimum(k_start + BLOCK_K, M)
            b_keep = b_keep | ((k_start[None, :] < q_stop[:, None]) & (q_start[:, None] < k_stop[None, :]))
        if WITH_SIM:
            q_loose = tl.load(SimQ + q_rows + o_s, mask=m_s, other=1.0) < limit
            b_keep = b_keep | q_loose[:, None] | b_k_loose[None, :]
        b_keep = b_keep & m_tile
        if WITHIN:
            b_keep = b_keep & m_valid

        b_keep_i = b_keep.to(tl.int32)
        count = tl.sum(b_keep_i, 1)
        kept_mass = tl.sum(tl.where(b_keep, b_p, 0.0), 1)
        last = tl.max(tl.where(b_keep, o_k[None, :], 0), 1)
        slot = tl.cumsum(b_keep_i, 1) - 1
        p_index = Index + (q_rows + o_s[:, None]) * NUM_KV_BLOCKS
        tl.store(p_index + slot, o_k[None, :] + tl.zeros_like(slot), mask=b_keep)
        tl.store(p_index + o_k[None, :], last[:, None] + tl.zeros_like(slot),
                 mask=m_tile & (o_k[None, :] >= count[:, None]))
        tl.store(Keep + o_tile, b_keep.to(tl.int8), mask=m_tile)
        tl.store(Count + q_rows + o_s, count, mask=m_s)
        tl.store(KeptMass + q_rows + o_s, kept_mass, mask=m_s)


# --------------------------------------------------------------------------- launcher

def _block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


def _scalar_or_table(value, device, dtype) -> tuple[object, torch.Tensor | None]:
    """(scalar kernel argument, per-head table or None) for a resolved parameter."""
    if isinstance(value, torch.Tensor):
        return 0, value.to(device=device, dtype=dtype)
    return value, None


def triton_predict(q: torch.Tensor, k: torch.Tensor, *, rule_topk: int | torch.Tensor | None,
                   rule_topp: float | torch.Tensor | None, min_blocks: int, keep_sink: bool,
                   keep_diagonal: bool, similarity_threshold: float | torch.Tensor | None, block_q: int,
                   block_k: int, scale: float, within: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """Launch the pooling and selection kernels.

    q: [B, H, N, D], k: [B, H, M, D] (any strides, fp16/bf16/fp32). rule_topk: resolved top-k count (int or
    int32 [H]) or None when the rule has no top-k part; rule_topp likewise (float or float32 [H]).
    within: None or bool [B|1, H|1, QB, KB]: only these tiles are candidates, and only they can be kept.
    Returns keep bool [B, H, QB, KB], kv_count int32 [B, H, QB], kv_index int32 [B, H, QB, KB] and the
    kept pooled mass float32 [B, H, QB].
    """
    b, h, n, d = q.shape
    m = k.shape[2]
    qb, kb = triton.cdiv(n, block_q), triton.cdiv(m, block_k)
    device = q.device
    with_sim = similarity_threshold is not None
    block_d = _block_d(d)

    # One fp32 workspace (freed on return): pooled Q, pooled K, block similarities, scratch logits.
    sizes = (b * h * qb * d, b * h * kb * d, b * h * qb, b * h * kb, b * h * qb * kb)
    work = torch.empty(sum(sizes), device=device, dtype=torch.float32)
    pooled_q, pooled_k, sim_q, sim_k, scratch = torch.split(work, sizes)
    kept_mass = torch.empty((b, h, qb), device=device, dtype=torch.float32)
    tables = torch.empty(b * h * qb * (kb + 1), device=device, dtype=torch.int32)
    count, index = torch.split(tables, (b * h * qb, b * h * qb * kb))
    keep = torch.empty((b, h, qb, kb), device=device, dtype=torch.bool)

    _pool_kernel[(qb + kb, b * h)](
        q, k, pooled_q, pooled_k, sim_q, sim_k, *q.stride(), *k.stride(),
        h, n, m, qb, kb, SIMILARITY_EPS,
        HEAD_DIM=d, BLOCK_D=block_d, BLOCK_Q=block_q, BLOCK_K=block_k, WITH_SIM=with_sim,
    )

    topk_arg, topk_table = _scalar_or_table(rule_topk if rule_topk is not None else 0, device, torch.int32)
    topp_arg, topp_table = _scalar_or_table(rule_topp if rule_topp is not None else 0.0, device, torch.float32)
    sim_arg, sim_table = _scalar_or_table(similarity_threshold if with_sim else 0.0, device, torch.float32)
    block_kb = max(16, triton.next_power_of_2(kb))
    within_i8 = within.view(torch.int8) if within is not None else None
    within_strides = (0, 0, 0) if within is None else (
        within.stride(0) if within.shape[0] > 1 else 0, within.stride(1) if within.shape[1] > 1 else 0,
        within.stride(2))
    sel_rows = max(1, min(_ROWS, _SELECT_TILE_ELEMENTS // block_kb))
    _select_kernel[(triton.cdiv(qb, _ROWS), b * h)](
        pooled_q, pooled_k, sim_q, sim_k, scratch, keep.view(torch.int8), count, index, kept_mass,
        topk_table if topk_table is not None else count,
        topp_table if topp_table is not None else kept_mass,
        sim_table if sim_table is not None else kept_mass,
        within_i8 if within is not None else keep.view(torch.int8),
        topk_arg, float(topp_arg), float(sim_arg), min_blocks, *within_strides,
        h, n, m, qb, kb, scale * LOG2E,
        HEAD_DIM=d, BLOCK_D=block_d, BLOCK_Q=block_q, BLOCK_K=block_k,
        ROWS=_ROWS, CHUNK=_CHUNK, DOT_K=min(block_d, _DOT_K), BLOCK_KB=block_kb, SEL_ROWS=sel_rows,
        USE_TOPK=rule_topk is not None, USE_TOPP=rule_topp is not None,
        TOPK_PER_HEAD=topk_table is not None, TOPP_PER_HEAD=topp_table is not None,
        SIM_PER_HEAD=sim_table is not None, KEEP_SINK=keep_sink, KEEP_DIAGONAL=keep_diagonal,
        WITH_SIM=with_sim, WITHIN=within is not None, DOT_PRECISION="ieee" if _INTERPRET else "tf32x3",
    )
    return keep, count.view(b, h, qb), index.view(b, h, qb, kb), kept_mass
