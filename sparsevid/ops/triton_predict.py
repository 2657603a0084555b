"""Triton kernels for mask prediction: block pooling, pooled scores, selection and the index table.

Three kinds of program do the work:

* A pool program reads one tile of ``POOL_TOKENS`` tokens of one head (one or two query blocks, or two to
  four key blocks), ``POOL_CHUNK`` tokens at a time, streamed past the L2 cache (``evict_first``), and writes
  the fp32 block means (and, when asked, the block self-similarities, see ``pooling.py``). Pooling reads all
  of Q and K: it sets the floor of the prediction time.
* A logits program takes a [ROWS, SPAN] tile of one head's pooled map (query blocks x key blocks) and
  computes its base-2 pooled logits ``q_bar @ k_bar^T`` with ``tl.dot`` (3xTF32 on the GPU), ``CHUNK`` key
  blocks at a time, into a logits buffer of B*H*QB rows of KB entries. The rows are padded to whole 128-byte
  lines (``logits_stride`` entries), so that the tile stores write whole memory sectors and the select
  stage's row loads are vectorized whatever KB is (the Wan 14B shape has KB = 1,182).
* A select program takes ``SEL_ROWS`` rows (usually one) with whole rows in registers: it takes the softmax
  (row maximum and sum), finds the rule's threshold, and writes the outputs ``OUT_CHUNK`` columns at a time:
  option tiles, keep row, kept mass and the compacted index table row (count and ascending indices by a
  running prefix sum, padded with the last kept index, as ``kept_index_table`` lays it out). Passes over a
  row after the first read its logits again and recompute the probabilities with the same instructions
  (bit-identical), rather than storing them: the logits stay read-only.

Threshold: the largest ``tau`` with ``count(p >= tau) >= k_eff`` and ``mass(p >= tau) >= p_target`` (see
``selection.py``), found by bisection on the float's bit pattern (probabilities are non-negative, so their
bit patterns order like their values); each step counts and sums the entries above the midpoint. While a
row's bracket ``[lo, hi)`` holds more than ``COMPACT`` entries the steps scan the whole row; then the
bracket's entries are packed into the row of the index table (not written yet) and the remaining steps scan
only those, with the count and mass above ``hi`` carried as constants (``COMPACT`` = 0: the whole row is
searched to the end, which saves the packing pass's memory round trips on short rows). The search stops
once a single entry separates the bounds. The search is a long chain of dependent row reductions: one-warp
programs keep those reductions inside a warp, and one row per program gives the GPU enough independent
chains. The bracket's final entries all equal ``tau`` (or are a single entry): every entry above it is kept,
and of the bracket either all (the top-p part needs them) or, when only the top-k count binds, the
lowest-index ``k_eff - count(p >= hi)``, counted by a running prefix sum as the outputs are written; so the
top-k part keeps exactly ``k_eff`` entries, as the stable sort of ``selection.py`` does. NaN probabilities
(rows made non-finite by NaN or inf inputs) count as 0, as there.

The three stages run as three launches (:class:`PredictLaunch`), each autotuned on its own; pooling is
memory bound. ``benchmarks/NOTES.md`` ("Mask prediction") records the measurements behind this design and
the alternatives tried.

Set ``TRITON_INTERPRET=1`` before importing this module to run the kernels on the CPU (tests).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .mask import num_blocks
from .pooling import SIMILARITY_EPS
from .triton_attention import LOG2E, padded_pow2
from .triton_launch import AUTOTUNE, INTERPRET, launch_tuned

# Candidate configs; the autotuner times them per shape key (the first alone runs when interpreted or with
# autotuning off). POOL_TOKENS: tokens per pool program (a multiple of both block sizes, 64 and 128), read
# POOL_CHUNK at a time (a divisor of 64); ROWS: query-block rows per logits program (>= 16 for tl.dot), SPAN
# key blocks per program, CHUNK key blocks per dot; SEL_TILE: entries of a search tile [SEL_ROWS, BLOCK_KB]
# of a select program, at least one row; OUT_TILE: entries of its output tiles [SEL_ROWS, OUT_CHUNK];
# COMPACT: bracket entries below which the search packs the bracket (0: never). With one warp a select
# program's row reductions (each bisection step's count and mass) stay within the warp, without barriers,
# and many small programs keep every SM busy.
POOL_CONFIGS = [triton.Config(dict(POOL_TOKENS=128, POOL_CHUNK=16), num_warps=1, num_stages=1),
                 triton.Config(dict(POOL_TOKENS=128, POOL_CHUNK=16), num_warps=1, num_stages=2),
                 triton.Config(dict(POOL_TOKENS=128, POOL_CHUNK=32), num_warps=1, num_stages=1)]
# Logits configs fit the shared memory of an H200 (3xTF32 operands: 64-164 KB per program); CHUNK = 64
# key blocks is the M side of one warpgroup's dot. Tiles of one dot step (SPAN = CHUNK) give the short map of
# a small model (Wan 1.3B) more programs.
LOGITS_CONFIGS = [triton.Config(dict(ROWS=64, SPAN=256, CHUNK=64), num_warps=4, num_stages=1),
                   triton.Config(dict(ROWS=32, SPAN=256, CHUNK=64), num_warps=4, num_stages=1),
                   triton.Config(dict(ROWS=64, SPAN=64, CHUNK=64), num_warps=4, num_stages=1),
                   triton.Config(dict(ROWS=128, SPAN=256, CHUNK=64), num_warps=4, num_stages=1)]
SELECT_CONFIGS = [triton.Config(dict(SEL_TILE=512, OUT_TILE=256, COMPACT=0), num_warps=1, num_stages=1),
                   triton.Config(dict(SEL_TILE=512, OUT_TILE=128, COMPACT=0), num_warps=1, num_stages=1),
                   triton.Config(dict(SEL_TILE=512, OUT_TILE=1024, COMPACT=0), num_warps=1, num_stages=1),
                   triton.Config(dict(SEL_TILE=1024, OUT_TILE=256, COMPACT=64), num_warps=1, num_stages=1)]


def _configs(candidates: list[triton.Config]) -> list[triton.Config]:
    """The autotuning space: the first candidate alone when interpreted or with SPARSEVID_AUTOTUNE=off."""
    return candidates[:1] if INTERPRET or not AUTOTUNE else candidates


def _select_rows_per_group(args) -> int:
    """SEL_ROWS: rows of a [SEL_ROWS, BLOCK_KB] search tile of about SEL_TILE entries (at least one row)."""
    return max(1, args["SEL_TILE"] // args["BLOCK_KB"])


def _out_chunk(args) -> int:
    """OUT_CHUNK: columns of a [SEL_ROWS, OUT_CHUNK] output tile of about OUT_TILE entries."""
    return max(32, min(args["BLOCK_KB"], args["OUT_TILE"] // args["SEL_ROWS"]))


def _search_whole(args) -> bool:
    """SEARCH_WHOLE: the search never packs (COMPACT = 0, or rows no longer than COMPACT)."""
    return args["COMPACT"] == 0 or args["HEAD_KB"] + args["TAIL_KB"] <= args["COMPACT"]


# In order: OUT_CHUNK needs SEL_ROWS.
_SELECT_HEURISTICS = {"SEL_ROWS": _select_rows_per_group, "OUT_CHUNK": _out_chunk, "SEARCH_WHOLE": _search_whole}


SCORE_PRECISIONS = ("tf32x3", "tf32")

_POOL_KEY = ["HEAD_DIM", "BLOCK_Q", "BLOCK_K", "WITH_SIM"]
_LOGITS_KEY = ["HEAD_DIM", "BLOCK_KB", "DOT_PRECISION"]
_SELECT_KEY = ["HEAD_DIM", "BLOCK_Q", "BLOCK_K", "BLOCK_KB", "TAIL_KB", "USE_TOPK", "USE_TOPP", "WITH_SIM", "WITHIN"]


# --------------------------------------------------------------------------- pooling

@triton.jit
def _pool_tile(p_x, stride_n, stride_d, length, num_blocks, tile, p_mean, p_sim, eps,
               HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK: tl.constexpr, TILE_BLOCKS: tl.constexpr,
               POOL_CHUNK: tl.constexpr, WITH_SIM: tl.constexpr):
    """Means [TILE_BLOCKS, HEAD_DIM] (and self-similarities) of blocks tile*TILE_BLOCKS... of one head.

    p_x: the head's first token; p_mean, p_sim: the head's first pooled row / similarity. The blocks' tokens
    are read POOL_CHUNK at a time (a [TILE_BLOCKS, POOL_CHUNK, BLOCK_D] load) into fp32 sums.
    """
    o_b = tile * TILE_BLOCKS + tl.arange(0, TILE_BLOCKS)
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < HEAD_DIM
    b_sum = tl.zeros([TILE_BLOCKS, BLOCK_D], dtype=tl.float32)
    b_unit_sum = tl.zeros([TILE_BLOCKS, BLOCK_D], dtype=tl.float32)
    for t0 in tl.range(0, BLOCK, POOL_CHUNK):
        o_t = o_b[:, None] * BLOCK + t0 + tl.arange(0, POOL_CHUNK)[None, :]
        m_x = (o_t < length)[:, :, None]
        if BLOCK_D != HEAD_DIM:
            m_x = m_x & m_d[None, None, :]
        p_chunk = p_x + o_t[:, :, None].to(tl.int64) * stride_n + o_d[None, None, :] * stride_d
        b_x = tl.load(p_chunk, mask=m_x, other=0.0, eviction_policy="evict_first").to(tl.float32)
        b_sum += tl.sum(b_x, 1)
        if WITH_SIM:
            b_norm = tl.sqrt(tl.sum(b_x * b_x, 2))
            b_unit_sum += tl.sum(b_x / tl.maximum(b_norm, eps)[:, :, None], 1)
    n_tokens = tl.maximum(tl.minimum(length - o_b * BLOCK, BLOCK), 1).to(tl.float32)
    b_mean = b_sum / n_tokens[:, None]
    m_b = o_b < num_blocks
    tl.store(p_mean + o_b[:, None] * HEAD_DIM + o_d[None, :], b_mean, mask=m_b[:, None] & m_d[None, :])
    if WITH_SIM:
        b_unit = b_unit_sum / n_tokens[:, None]
        mean_norm = tl.sqrt(tl.sum(b_mean * b_mean, 1))
        tl.store(p_sim + o_b, tl.sum(b_mean * b_unit, 1) / tl.maximum(mean_norm, eps), mask=m_b)


@triton.autotune(configs=_configs(POOL_CONFIGS), key=_POOL_KEY)
@triton.jit
def _pool_kernel(Q, K, PooledQ, PooledK, SimQ, SimK,
                 stride_qb, stride_qh, stride_qn, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
                 H, N, M, NUM_Q_BLOCKS, NUM_KV_BLOCKS, eps,
                 HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
                 WITH_SIM: tl.constexpr, POOL_TOKENS: tl.constexpr, POOL_CHUNK: tl.constexpr):
    """Pool tile ``program_id(0)`` of batch-head ``program_id(1)``: tiles [0, QT) are query tiles, the rest
    key tiles. Grid (query tiles + key tiles, B*H)."""
    unit = tl.program_id(0)
    bh = tl.program_id(1)
    i_b = (bh // H).to(tl.int64)
    i_h = (bh % H).to(tl.int64)
    q_tiles = tl.cdiv(NUM_Q_BLOCKS, POOL_TOKENS // BLOCK_Q)
    if unit < q_tiles:
        row = bh.to(tl.int64) * NUM_Q_BLOCKS
        _pool_tile(Q + i_b * stride_qb + i_h * stride_qh, stride_qn, stride_qd, N, NUM_Q_BLOCKS, unit,
                   PooledQ + row * HEAD_DIM, SimQ + row, eps, HEAD_DIM, BLOCK_D, BLOCK_Q, POOL_TOKENS // BLOCK_Q,
                   POOL_CHUNK, WITH_SIM)
    else:
        row = bh.to(tl.int64) * NUM_KV_BLOCKS
        _pool_tile(K + i_b * stride_kb + i_h * stride_kh, stride_kn, stride_kd, M, NUM_KV_BLOCKS, unit - q_tiles,
                   PooledK + row * HEAD_DIM, SimK + row, eps, HEAD_DIM, BLOCK_D, BLOCK_K, POOL_TOKENS // BLOCK_K,
                   POOL_CHUNK, WITH_SIM)


# --------------------------------------------------------------------------- selection

@triton.jit
def _per_head_value(scalar, p_values, i_h, PER_HEAD: tl.constexpr):
    if PER_HEAD:
        return tl.load(p_values + i_h)
    return scalar


@triton.jit
def _bisect(b_p, b_t, lo, hi, cnt_lo, cnt_hi, mass_hi, cnt_base, mass_base, k_eff, target, limit,
            TAILED: tl.constexpr):
    """Bisection steps on the bit patterns [lo, hi) (int32 [R]) while a row's bracket holds more than
    ``limit`` entries (and is more than one pattern wide).

    b_p: float32 [R, C], the entries that may lie in the bracket (others hold -1), and with TAILED more of
    them in b_t [R, C2]; cnt_base, mass_base: count and mass of the row's entries above them. cnt_lo / cnt_hi:
    count(p >= lo) / count(p >= hi), mass_hi: mass(p >= hi); lo always satisfies the rule, hi never does.
    Returns the updated lo, hi, cnt_lo, cnt_hi, mass_hi.

    Each entry's test is one float (1 or 0): its sum is the count (exact below 2**24) and its product with the
    entry, summed, the mass, so that an entry costs a compare, an add and a fused multiply-add.
    """
    active = ((hi - lo) > 1) & ((cnt_lo - cnt_hi) > limit)
    while tl.max(active.to(tl.int32), 0) > 0:
        mid = lo + (hi - lo) // 2
        mid_f = mid.to(tl.float32, bitcast=True)[:, None]
        b_ge = tl.where(b_p >= mid_f, 1.0, 0.0)
        cnt = tl.sum(b_ge, 1)
        mass = tl.sum(b_ge * b_p, 1) + mass_base
        if TAILED:
            b_ge_t = tl.where(b_t >= mid_f, 1.0, 0.0)
            cnt += tl.sum(b_ge_t, 1)
            mass += tl.sum(b_ge_t * b_t, 1)
        cnt = cnt.to(tl.int32) + cnt_base
        ok = (cnt >= k_eff) & (mass >= target)
        up = active & ok
        down = active & ~ok
        lo = tl.where(up, mid, lo)
        cnt_lo = tl.where(up, cnt, cnt_lo)
        hi = tl.where(down, mid, hi)
        cnt_hi = tl.where(down, cnt, cnt_hi)
        mass_hi = tl.where(down, mass, mass_hi)
        active = ((hi - lo) > 1) & ((cnt_lo - cnt_hi) > limit)
    return lo, hi, cnt_lo, cnt_hi, mass_hi


@triton.jit
def _row_logits(p_rows, o_cols, m_rows, NUM_KV_BLOCKS, logits_stride):
    """A row tile's logits [R, C] at columns o_cols [C] of the logits rows p_rows (pointers [R]); -inf past
    the row and for rows outside m_rows. The load itself runs to the end of the padded rows (logits_stride, a
    multiple of 32), so that it is not split at the row's last column and stays vectorized."""
    m_cols = o_cols < NUM_KV_BLOCKS
    b_s = tl.load(p_rows[:, None] + o_cols[None, :], mask=m_rows[:, None] & (o_cols < logits_stride)[None, :],
                  cache_modifier=".cg")
    return tl.where(m_rows[:, None] & m_cols[None, :], b_s, float("-inf"))


@triton.jit
def _candidates(b_p, p_within, o_cols, m_rows, NUM_KV_BLOCKS, WITHIN: tl.constexpr):
    """Probabilities b_p [R, C] at columns o_cols [C] with -1 for columns past the row, rows outside m_rows [R]
    and, with WITHIN, tiles outside the earlier mask (p_within: pointers [R, 1] to its rows); NaN becomes 0
    (a row made non-finite by its inputs, see ``selection.py``)."""
    m_tile = m_rows[:, None] & (o_cols < NUM_KV_BLOCKS)[None, :]
    if WITHIN:
        m_tile &= tl.load(p_within + o_cols[None, :], mask=m_tile, other=0) != 0
    return tl.where(m_tile, tl.where(b_p == b_p, b_p, 0.0), -1.0)


@triton.jit
def _chunk_probs(p_rows, o_cols, m_rows, row_max, inv_sum, p_within, NUM_KV_BLOCKS, logits_stride,
                 WITHIN: tl.constexpr):
    """Candidate probabilities [R, C] (-1 elsewhere) at columns o_cols [C], recomputed from the logits with
    the instructions that made the row tiles' (row_max, inv_sum: float32 [R])."""
    b_e = tl.math.exp2(_row_logits(p_rows, o_cols, m_rows, NUM_KV_BLOCKS, logits_stride) - row_max[:, None])
    return _candidates(b_e * inv_sum[:, None], p_within, o_cols, m_rows, NUM_KV_BLOCKS, WITHIN)


@triton.jit
def _threshold_bits(b_p, b_t, k_eff, target, p_rows, m_rows, row_max, inv_sum, p_within, p_buffer,
                    NUM_KV_BLOCKS, logits_stride, TAILED: tl.constexpr, SEARCH_WHOLE: tl.constexpr,
                    COMPACT: tl.constexpr, OUT_CHUNK: tl.constexpr, WITHIN: tl.constexpr):
    """(lo, hi, fill), int32 [R] each: lo is the bit pattern of the largest tau with count(p >= tau) >= k_eff and
    mass(p >= tau) >= target; every entry >= hi is kept, and of the entries in [lo, hi) (all equal to tau, or
    a single one) the ``fill`` lowest-index ones: all of them where the mass above hi falls short of the
    target, else the ``k_eff - count(p >= hi)`` the top-k count still needs.

    b_p: float32 [R, HEAD_KB], the row's columns [0, HEAD_KB), and with TAILED b_t [R, TAIL_KB], those after
    them: probabilities of the candidates, -1 elsewhere (padding, non-candidates), as ``_chunk_probs``
    recomputes them from the logits rows p_rows (pointers [R] to rows of NUM_KV_BLOCKS floats, logits_stride
    apart; rows m_rows) with row_max, inv_sum and p_within. p_buffer: pointers [R] to int32 rows of
    NUM_KV_BLOCKS that this program owns and overwrites later. SEARCH_WHOLE: the search scans the whole row
    to the end, without packing (``_search_whole``). The lower bound starts at the row's smallest candidate
    (where every candidate qualifies), the upper bound just above the row maximum.
    """
    lo = tl.min(tl.where(b_p >= 0.0, b_p, 2.0), 1)
    hi = tl.max(b_p, 1)
    cnt_lo = tl.sum((b_p >= 0.0).to(tl.int32), 1)
    if TAILED:
        lo = tl.minimum(lo, tl.min(tl.where(b_t >= 0.0, b_t, 2.0), 1))
        hi = tl.maximum(hi, tl.max(b_t, 1))
        cnt_lo += tl.sum((b_t >= 0.0).to(tl.int32), 1)
    lo = lo.to(tl.int32, bitcast=True)
    hi = hi.to(tl.int32, bitcast=True) + 1
    cnt_hi = tl.zeros_like(lo)
    mass_hi = tl.zeros_like(lo).to(tl.float32)
    limit = COMPACT
    if SEARCH_WHOLE:
        limit = 1
    lo, hi, cnt_lo, cnt_hi, mass_hi = _bisect(b_p, b_t, lo, hi, cnt_lo, cnt_hi, mass_hi, 0, 0.0, k_eff, target,
                                              limit, TAILED)
    if not SEARCH_WHOLE:
        # Pack each open row's bracket entries (at most COMPACT) into its buffer, OUT_CHUNK columns at a time.
        is_open = ((hi - lo) > 1) & ((cnt_lo - cnt_hi) > 1)
        lo_f = lo.to(tl.float32, bitcast=True)
        hi_f = hi.to(tl.float32, bitcast=True)
        packed = tl.zeros_like(lo)
        for c0 in range(0, NUM_KV_BLOCKS, OUT_CHUNK):
            o_c = c0 + tl.arange(0, OUT_CHUNK)
            b_c = _chunk_probs(p_rows, o_c, m_rows & is_open, row_max, inv_sum, p_within, NUM_KV_BLOCKS,
                               logits_stride, WITHIN)
            b_in = is_open[:, None] & (b_c >= lo_f[:, None]) & (b_c < hi_f[:, None])
            slot = packed[:, None] + tl.cumsum(b_in.to(tl.int32), 1) - 1
            tl.store(p_buffer[:, None] + slot, b_c.to(tl.int32, bitcast=True), mask=b_in)
            packed += tl.sum(b_in.to(tl.int32), 1)
        tl.debug_barrier()
        o_w = tl.arange(0, COMPACT)
        m_w = o_w[None, :] < packed[:, None]
        b_w = tl.load(p_buffer[:, None] + o_w[None, :], mask=m_w, other=0).to(tl.float32, bitcast=True)
        b_w = tl.where(m_w, b_w, -1.0)
        lo, hi, cnt_lo, cnt_hi, mass_hi = _bisect(b_w, b_w, lo, hi, cnt_lo, cnt_hi, mass_hi, cnt_hi, mass_hi,
                                                  k_eff, target, 1, False)
    fill = tl.where(mass_hi < target, cnt_lo - cnt_hi, k_eff - cnt_hi)
    return lo, hi, fill


@triton.autotune(configs=_configs(LOGITS_CONFIGS), key=_LOGITS_KEY)
@triton.jit
def _logits_kernel(PooledQ, PooledK, Logits, NUM_Q_BLOCKS, NUM_KV_BLOCKS, logits_stride, scale_log2,
                   HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_KB: tl.constexpr,
                   DOT_PRECISION: tl.constexpr, ROWS: tl.constexpr, SPAN: tl.constexpr, CHUNK: tl.constexpr):
    """Base-2 pooled logits of tile ``program_id(0)`` (ROWS query-block rows x SPAN key blocks, row tiles
    outer) of batch-head ``program_id(1)``, CHUNK key blocks per tl.dot, into their logits rows.
    Grid (cdiv(QB, ROWS) * cdiv(KB, SPAN), B*H).

    Each dot computes a [CHUNK, ROWS] tile (key blocks x query blocks): the query tile, the same in every
    step, is then the dot's shared-memory operand, read by the tensor cores in place, while the key tile is
    split for 3xTF32 in registers."""
    spans = tl.cdiv(NUM_KV_BLOCKS, SPAN)
    unit = tl.program_id(0) // spans
    first = (tl.program_id(0) % spans) * SPAN
    bh = tl.program_id(1)
    q_rows = bh.to(tl.int64) * NUM_Q_BLOCKS          # first row of this batch-head in [B*H*QB, ...]
    p_kbar = PooledK + bh.to(tl.int64) * NUM_KV_BLOCKS * HEAD_DIM
    o_r = unit * ROWS + tl.arange(0, ROWS)
    m_r = o_r < NUM_Q_BLOCKS
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < HEAD_DIM
    b_qbar = tl.load(PooledQ + (q_rows + o_r[:, None]) * HEAD_DIM + o_d[None, :], mask=m_r[:, None] & m_d[None, :],
                     other=0.0, cache_modifier=".cg")
    p_logits = Logits + (q_rows + o_r[:, None]) * logits_stride
    o_j = tl.arange(0, CHUNK)
    for c in tl.range(first, tl.minimum(first + SPAN, NUM_KV_BLOCKS), CHUNK):
        m_j = (c + o_j) < NUM_KV_BLOCKS
        b_kbar = tl.load(p_kbar + (c + o_j)[:, None] * HEAD_DIM + o_d[None, :], mask=m_j[:, None] & m_d[None, :],
                         other=0.0, cache_modifier=".cg")
        b_st = tl.dot(b_kbar, tl.trans(b_qbar), input_precision=DOT_PRECISION)
        tl.store(tl.trans(p_logits) + (c + o_j)[:, None], b_st * scale_log2, mask=m_j[:, None] & m_r[None, :])


@triton.autotune(configs=_configs(SELECT_CONFIGS), key=_SELECT_KEY)
@triton.heuristics(_SELECT_HEURISTICS)
@triton.jit
def _select_kernel(SimQ, SimK, Logits, Keep, Count, Index, KeptMass,
                   TopkPerHead, ToppPerHead, SimPerHead, Within,
                   topk, topp, sim_threshold, min_blocks, stride_wb, stride_wh, stride_wr,
                   H, N, M, NUM_Q_BLOCKS, NUM_KV_BLOCKS, logits_stride,
                   HEAD_DIM: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, WITH_SIM: tl.constexpr,
                   BLOCK_KB: tl.constexpr, HEAD_KB: tl.constexpr, TAIL_KB: tl.constexpr,
                   USE_TOPK: tl.constexpr, USE_TOPP: tl.constexpr,
                   TOPK_PER_HEAD: tl.constexpr, TOPP_PER_HEAD: tl.constexpr, SIM_PER_HEAD: tl.constexpr,
                   KEEP_SINK: tl.constexpr, KEEP_DIAGONAL: tl.constexpr, WITHIN: tl.constexpr,
                   SEL_TILE: tl.constexpr, OUT_TILE: tl.constexpr, COMPACT: tl.constexpr,
                   SEL_ROWS: tl.constexpr, OUT_CHUNK: tl.constexpr, SEARCH_WHOLE: tl.constexpr):
    """Query-block rows program_id(0)*SEL_ROWS... of batch-head ``program_id(1)`` (their logits in the
    logits rows): softmax, threshold, options and outputs. Grid (cdiv(QB, SEL_ROWS), B*H).

    The packing and the outputs read the logits again in chunks of OUT_CHUNK columns and recompute the
    probabilities (``_chunk_probs``); only the search keeps whole rows in registers, as two tiles (columns
    [0, HEAD_KB) and the TAIL_KB after them, powers of two) so that a row of, say, 1,182 key blocks takes
    1,280 registers' worth of entries, not 2,048.
    """
    unit = tl.program_id(0)
    bh = tl.program_id(1)
    i_h = bh % H
    k_eff = min_blocks
    if USE_TOPK:
        k_eff = tl.maximum(_per_head_value(topk, TopkPerHead, i_h, TOPK_PER_HEAD), k_eff)
    k_eff = tl.minimum(k_eff, NUM_KV_BLOCKS)
    target = 0.0
    if USE_TOPP:
        target = _per_head_value(topp, ToppPerHead, i_h, TOPP_PER_HEAD)
    if WITH_SIM:
        limit = _per_head_value(sim_threshold, SimPerHead, i_h, SIM_PER_HEAD)
    o_k = tl.arange(0, HEAD_KB)
    o_s = unit * SEL_ROWS + tl.arange(0, SEL_ROWS)
    m_s = o_s < NUM_Q_BLOCKS
    rows = bh.to(tl.int64) * NUM_Q_BLOCKS + o_s      # int64 [SEL_ROWS]: rows of [B*H*QB, KB] outputs
    p_rows = Logits + rows * logits_stride
    b_s = _row_logits(p_rows, o_k, m_s, NUM_KV_BLOCKS, logits_stride)
    row_max = tl.max(b_s, 1)
    if TAIL_KB > 0:
        o_t = HEAD_KB + tl.arange(0, TAIL_KB)
        b_st = _row_logits(p_rows, o_t, m_s, NUM_KV_BLOCKS, logits_stride)
        row_max = tl.maximum(row_max, tl.max(b_st, 1))
    row_max = tl.where(m_s, row_max, 0.0)
    b_e = tl.math.exp2(b_s - row_max[:, None])
    row_sum = tl.sum(b_e, 1)
    if TAIL_KB > 0:
        b_et = tl.math.exp2(b_st - row_max[:, None])
        row_sum += tl.sum(b_et, 1)
    inv_sum = 1.0 / tl.where(m_s, row_sum, 1.0)
    # Only the tiles of the earlier mask (WITHIN) are candidates; the softmax still spans the whole row.
    p_within = Within + (bh // H).to(tl.int64) * stride_wb + i_h * stride_wh + o_s[:, None] * stride_wr
    b_p = _candidates(b_e * inv_sum[:, None], p_within, o_k, m_s, NUM_KV_BLOCKS, WITHIN)
    b_t = b_p  # the second tile (none when TAIL_KB is 0: then b_p stands in, unread)
    if TAIL_KB > 0:
        b_t = _candidates(b_et * inv_sum[:, None], p_within, o_t, m_s, NUM_KV_BLOCKS, WITHIN)

    p_index = Index + rows * NUM_KV_BLOCKS
    lo, hi, fill = _threshold_bits(b_p, b_t, k_eff, target, p_rows, m_s, row_max, inv_sum, p_within, p_index,
                                   NUM_KV_BLOCKS, logits_stride, TAIL_KB > 0, SEARCH_WHOLE, COMPACT, OUT_CHUNK,
                                   WITHIN)
    tau = lo.to(tl.float32, bitcast=True)
    above = hi.to(tl.float32, bitcast=True)  # entries >= above are kept; of those in [tau, above), the first fill
    if USE_TOPP:
        tau = tl.where(target >= 1.0, 0.0, tau)
        above = tl.where(target >= 1.0, 0.0, above)
    if WITH_SIM:
        q_loose = tl.load(SimQ + rows, mask=m_s, other=1.0, cache_modifier=".cg") < limit
    tl.debug_barrier()

    # Outputs: keep row, then the kept columns in ascending order at their prefix-sum slots. The kept mass and
    # the last kept column are reduced over the row once, after the loop, from per-column accumulators.
    count = tl.zeros_like(o_s)
    ties = tl.zeros_like(o_s)  # entries in [tau, above) met so far
    b_kept_mass = tl.zeros([SEL_ROWS, OUT_CHUNK], dtype=tl.float32)
    b_last = tl.zeros([SEL_ROWS, OUT_CHUNK], dtype=tl.int32)
    for c0 in range(0, NUM_KV_BLOCKS, OUT_CHUNK):
        o_c = c0 + tl.arange(0, OUT_CHUNK)
        m_c = m_s[:, None] & (o_c < NUM_KV_BLOCKS)[None, :]
        b_c = _chunk_probs(p_rows, o_c, m_s, row_max, inv_sum, p_within, NUM_KV_BLOCKS, logits_stride, WITHIN)
        b_above = b_c >= above[:, None]
        b_tied = ((b_c >= tau[:, None]) & ~b_above).to(tl.int32)
        b_keep = b_above | ((b_tied != 0) & (ties[:, None] + tl.cumsum(b_tied, 1) <= fill[:, None]))
        ties += tl.sum(b_tied, 1)
        if KEEP_SINK:
            b_keep = b_keep | (o_c == 0)[None, :]
        if KEEP_DIAGONAL:
            q_start = o_s * BLOCK_Q
            q_stop = tl.minimum(q_start + BLOCK_Q, N)
            k_start = o_c * BLOCK_K
            k_stop = tl.minimum(k_start + BLOCK_K, M)
            b_keep = b_keep | ((k_start[None, :] < q_stop[:, None]) & (q_start[:, None] < k_stop[None, :]))
        if WITH_SIM:
            k_loose = tl.load(SimK + bh.to(tl.int64) * NUM_KV_BLOCKS + o_c, mask=o_c < NUM_KV_BLOCKS,
                              other=1.0, cache_modifier=".cg") < limit
            b_keep = b_keep | q_loose[:, None] | k_loose[None, :]
        b_keep = b_keep & (b_c >= 0.0)
        tl.store(Keep + rows[:, None] * NUM_KV_BLOCKS + o_c[None, :], b_keep.to(tl.int8), mask=m_c)
        b_keep_i = b_keep.to(tl.int32)
        slot = count[:, None] + tl.cumsum(b_keep_i, 1) - 1
        tl.store(p_index[:, None] + slot, o_c[None, :] + tl.zeros_like(slot), mask=b_keep)
        count += tl.sum(b_keep_i, 1)
        b_kept_mass += tl.where(b_keep, b_c, 0.0)
        b_last = tl.maximum(b_last, tl.where(b_keep, o_c[None, :], 0))
    kept_mass = tl.sum(b_kept_mass, 1)
    last = tl.max(b_last, 1)
    for c0 in range(0, NUM_KV_BLOCKS, OUT_CHUNK):
        o_c = c0 + tl.arange(0, OUT_CHUNK)
        m_pad = m_s[:, None] & (o_c < NUM_KV_BLOCKS)[None, :] & (o_c[None, :] >= count[:, None])
        tl.store(p_index[:, None] + o_c[None, :], last[:, None] + tl.zeros_like(o_c)[None, :], mask=m_pad)
    tl.store(Count + rows, count, mask=m_s)
    tl.store(KeptMass + rows, kept_mass, mask=m_s)


# --------------------------------------------------------------------------- launcher

def _scalar_or_table(value, device, dtype) -> tuple[object, torch.Tensor | None]:
    """(scalar kernel argument, per-head table or None) for a resolved parameter."""
    if isinstance(value, torch.Tensor):
        return 0, value.to(device=device, dtype=dtype)
    return value, None


class PredictLaunch:
    """The buffers and kernel arguments of one prediction.

    q: [B, H, N, D], k: [B, H, M, D] (any strides, fp16/bf16/fp32). rule_topk: resolved top-k count (int or
    int32 [H]) or None when the rule has no top-k part; rule_topp likewise (float or float32 [H]).
    within: None or bool [B|1, H|1, QB, KB]: only these tiles are candidates, and only they can be kept.
    score_precision: the pooled logits' ``tl.dot`` precision on the GPU: "tf32x3" (fp32 accuracy, the
    default) or "tf32" (one TF32 product: faster, but rows whose threshold falls among near-equal scores then
    often keep other tiles than the PyTorch path; ``benchmarks/predict_limits.py`` measures both). Interpreted
    kernels compute in fp32 ("ieee") either way.

    ``run()`` (``pool()``, ``logits()`` then ``select()``) fills ``outputs``: keep bool
    [B, H, QB, KB], kv_count int32 [B, H, QB], kv_index int32 [B, H, QB, KB] and the kept pooled mass
    float32 [B, H, QB].
    """

    def __init__(self, q: torch.Tensor, k: torch.Tensor, *, rule_topk, rule_topp, min_blocks: int,
                 keep_sink: bool, keep_diagonal: bool, similarity_threshold, block_q: int, block_k: int,
                 scale: float, within: torch.Tensor | None = None, score_precision: str = "tf32x3"):
        if score_precision not in SCORE_PRECISIONS:
            raise ValueError(f"score_precision must be one of {SCORE_PRECISIONS}, got {score_precision!r}")
        b, h, n, d = q.shape
        m = k.shape[2]
        qb, kb = num_blocks(n, block_q), num_blocks(m, block_k)
        device = q.device
        with_sim = similarity_threshold is not None

        # One fp32 workspace: pooled logits (first, so that their padded rows start on 128-byte lines), pooled
        # Q, pooled K, block similarities.
        logits_stride = num_blocks(kb, 32) * 32
        sizes = (b * h * qb * logits_stride, b * h * qb * d, b * h * kb * d, b * h * qb, b * h * kb)
        logits, pooled_q, pooled_k, sim_q, sim_k = torch.empty(sum(sizes), device=device,
                                                               dtype=torch.float32).split(sizes)
        # The outputs are separate tensors: the prediction op returns them, and a custom op's outputs may not share
        # memory.
        kept_mass = torch.empty((b, h, qb), device=device, dtype=torch.float32)
        count = torch.empty((b, h, qb), device=device, dtype=torch.int32)
        index = torch.empty((b, h, qb, kb), device=device, dtype=torch.int32)
        keep = torch.empty((b, h, qb, kb), device=device, dtype=torch.bool)
        self.outputs = (keep, count, index, kept_mass)

        topk_arg, topk_table = _scalar_or_table(rule_topk if rule_topk is not None else 0, device, torch.int32)
        topp_arg, topp_table = _scalar_or_table(rule_topp if rule_topp is not None else 0.0, device,
                                                torch.float32)
        sim_arg, sim_table = _scalar_or_table(similarity_threshold if with_sim else 0.0, device, torch.float32)
        within_strides = (0, 0, 0) if within is None else (
            within.stride(0) if within.shape[0] > 1 else 0, within.stride(1) if within.shape[1] > 1 else 0,
            within.stride(2))
        keep_i8 = keep.view(torch.int8)
        self._q, self._k = q, k
        self._means, self._similarities, self._pooled_logits = (pooled_q, pooled_k), (sim_q, sim_k), logits
        # Absent per-head tables and mask get any int32 / float32 / int8 buffer: the kernels never read them.
        self._select_tensors = (logits, keep_i8, count, index, kept_mass,
                                count if topk_table is None else topk_table,
                                kept_mass if topp_table is None else topp_table,
                                kept_mass if sim_table is None else sim_table,
                                keep_i8 if within is None else within.view(torch.int8))
        self._strides = (*q.stride(), *k.stride())
        self._rule_args = (topk_arg, float(topp_arg), float(sim_arg), min_blocks, *within_strides)
        self._dims = (h, n, m, qb, kb)
        self._logits_stride = logits_stride
        self._bh, self._qb, self._kb, self._block_q, self._block_k = b * h, qb, kb, block_q, block_k
        self._scale_log2 = scale * LOG2E
        # With the constexpr arguments, what fixes each kernel's tuning key (the dtypes of q and k; the rest
        # are float32 / int32 / int8 buffers) and the device.
        self._tuning_key = (q.dtype, k.dtype, device)
        block_d, block_kb = padded_pow2(d), padded_pow2(kb)
        self._pool_meta = dict(HEAD_DIM=d, BLOCK_D=block_d, BLOCK_Q=block_q, BLOCK_K=block_k,
                               WITH_SIM=with_sim)
        head_kb, tail_kb = _row_tiles(kb)
        self._logits_meta = dict(HEAD_DIM=d, BLOCK_D=block_d, BLOCK_KB=block_kb,
                                 DOT_PRECISION="ieee" if INTERPRET else score_precision)
        self._select_meta = dict(
            HEAD_DIM=d, BLOCK_Q=block_q, BLOCK_K=block_k, WITH_SIM=with_sim, BLOCK_KB=block_kb,
            HEAD_KB=head_kb, TAIL_KB=tail_kb, USE_TOPK=rule_topk is not None, USE_TOPP=rule_topp is not None,
            TOPK_PER_HEAD=topk_table is not None, TOPP_PER_HEAD=topp_table is not None,
            SIM_PER_HEAD=sim_table is not None, KEEP_SINK=keep_sink, KEEP_DIAGONAL=keep_diagonal,
            WITHIN=within is not None)

    def _pool_units(self, meta) -> int:
        tokens = meta["POOL_TOKENS"]
        return num_blocks(self._qb, tokens // self._block_q) + num_blocks(self._kb, tokens // self._block_k)

    def _select_units(self, meta) -> int:
        return num_blocks(self._qb, _select_rows_per_group(meta))

    def pool(self, config: triton.Config | None = None) -> triton.Config:
        """Stage 1: the pooled rows (and similarities) into the workspace. Returns the config it ran with."""
        return _launch(_pool_kernel, config, lambda meta: (self._pool_units(meta), self._bh), self._tuning_key,
                self._q, self._k, *self._means, *self._similarities, *self._strides, *self._dims, SIMILARITY_EPS,
                **self._pool_meta)

    def logits(self, config: triton.Config | None = None) -> triton.Config:
        """Stage 2 (after ``pool``): the pooled logits into the logits buffer. Returns the config it ran with."""
        return _launch(_logits_kernel, config,
                lambda meta: (num_blocks(self._qb, meta["ROWS"]) * num_blocks(self._kb, meta["SPAN"]), self._bh),
                self._tuning_key, *self._means, self._pooled_logits, self._qb, self._kb, self._logits_stride,
                self._scale_log2, **self._logits_meta)

    def select(self, config: triton.Config | None = None) -> triton.Config:
        """Stage 3 (after ``logits``): the selection and the outputs. Returns the config it ran with."""
        return _launch(_select_kernel, config, lambda meta: (self._select_units(meta), self._bh), self._tuning_key,
                *self._similarities, *self._select_tensors, *self._rule_args, *self._dims, self._logits_stride,
                **self._select_meta)

    def run(self, configs: tuple = (None, None, None)) -> tuple[triton.Config, triton.Config, triton.Config]:
        """The three stages; configs: (pool, logits, select) candidate configs, None to autotune. Returns the
        configs they ran with."""
        pool_config, logits_config, select_config = configs
        return self.pool(pool_config), self.logits(logits_config), self.select(select_config)


def _row_tiles(kb: int) -> tuple[int, int]:
    """Columns of a select program's two row tiles for rows of kb entries: the largest power of two <= kb (at
    least 16), then the rest padded to a power of two (0: no second tile)."""
    head = max(16, 1 << (kb.bit_length() - 1))
    return head, (padded_pow2(kb - head) if kb > head else 0)


def _launch(kernel, config: triton.Config | None, grid, key: tuple, *args, **meta) -> triton.Config:
    """Launch an autotuned kernel with the config tuned for ``key`` (:func:`launch_tuned`), or with ``config``
    (one of its candidates) without tuning. Returns the config it ran with."""
    if config is None:
        return launch_tuned(kernel, grid, key, *args, **meta)
    kernel.fn[grid](*args, **meta, **config.all_kwargs())
    return config


def triton_predict(q: torch.Tensor, k: torch.Tensor, **options) -> tuple[torch.Tensor, ...]:
    """Pool, logits and select launches (``PredictLaunch.run``); options and the returned outputs as in
    :class:`PredictLaunch`."""
    launch = PredictLaunch(q, k, **options)
    launch.run()
    return launch.outputs
