"""precision="int8" block-sparse attention forward in Triton: INT8 Q K^T with int32 accumulation, FP8 (e4m3) P V
with fp32 accumulation, for GPUs with FP8 tensor cores (sm89, sm90+; int8 x int8 runs at the fp8 rate there).

:func:`quantize` prepares Q, K and V in two launches: per head K's smoothing vector (the mean of
``SMOOTH_SAMPLES`` keys) and the amax of V's chunks, then one launch whose programs each quantize a key block (K read
once to int8 with its scale, V to e4m3 in units of its head's power-of-two scale, stored tokens contiguous, the
layout an FP8 tensor-core product needs for its right operand, through a TMA store on Hopper) or a block of query
rows (int8 with one scale per row, and the row's smoothing shift). :func:`int8_forward` runs the bf16 forward's
online softmax over the kept tiles on the quantized inputs, two tiles per step: one row max and one rescale of the
accumulator per pair (V's scale is the head's, so the tiles of a step share its unit), the pair's two P V products
summed from zero by the tensor cores and added into the fp32 accumulator by the next step's FMA (Hopper's fp8 MMA
accumulates in reduced precision: accumulated there across all of a long row's tiles, the output's error doubled
with a full mask; see benchmarks/NOTES.md). Q comes quantized from memory rather than from the attention kernel's
prologue: quantized there, the int8 tile was kept in shared memory and re-read byte by byte on every iteration of
the loop (a fifth of its instructions; see benchmarks/NOTES.md). The rules are in :mod:`sparsevid.ops.int8`, the
PyTorch oracle in :mod:`sparsevid.ops.int8_reference`. Forward only (inference).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from . import triton_attention as bf16
from .fp8 import FP8_DTYPE
from .int8 import INT8_MAX, Int8Inputs, Int8Queries, SMOOTH_SAMPLES
from .triton_attention import (LOG2E, _configs, _load_rows, _prune, _program_rows, _rows_source, _store_rows,
                               _tile_schedule)
from .triton_fp8_attention import (_LOG2_P_SCALE, _abs_or_zero, _box_hook, _load_v, _pow2_scale, _tile_ptrs,
                                   _to_fp8)
from .triton_launch import INTERPRET, launch_tuned

_INT8_MAX = tl.constexpr(float(INT8_MAX))
_ROUND = tl.constexpr(12582912.0)  # 1.5 * 2^23: (y + _ROUND) - _ROUND rounds |y| < 2^22 half to even
_SMOOTH_CHUNK = 64  # sampled keys a smoothing program loads at once
_Q_ROWS = 64  # query rows a quantizing program owns
# keys of V per amax program, loaded a tile at a time: 256 measured 0.276 ms for the whole quantization at Wan 1.3B
# against 0.300 ms with 1024 (1.894 and 1.926 ms at 14B; H100, c13c13d)
_V_PART, _V_TILE = 256, 64
_PART_BLOCK = 64  # V's chunk amaxes a quantizing program reduces at once


# --------------------------------------------------------------------------- quantization

@triton.jit
def _int8_scale(amax, finite):
    """:func:`sparsevid.ops.int8.int8_scale`: amax / 127 (correctly rounded), 1 where amax is 0, NaN where not
    finite (scalars or tiles of one shape)."""
    scale = tl.where(amax == 0, 1.0, tl.math.div_rn(amax, tl.zeros_like(amax) + _INT8_MAX))
    return tl.where(finite, scale, float("nan"))


@triton.jit
def _round_int8(b_y):
    """int8 round-half-even(y) of float32 y scaled into [-127, 127], 0 where y is not finite."""
    b_r = (b_y + _ROUND) - _ROUND
    return tl.where(tl.abs(b_r) <= _INT8_MAX, b_r, 0.0).to(tl.int8)


@triton.jit
def _all_finite(b_x, axis: tl.constexpr):
    """Whether every element of float32 b_x is finite, reduced over ``axis`` (None: the whole tile)."""
    return tl.min((tl.abs(b_x) < float("inf")).to(tl.int32), axis) > 0


@triton.jit
def _finite_abs(b_x):
    """|x| where x is finite, 0 elsewhere (V's scale ignores NaN and inf; they become NaN in V8)."""
    return tl.where(tl.abs(b_x) < float("inf"), tl.abs(b_x), 0.0)


@triton.jit
def _int8_stats_kernel(K, V, KMean, VAmax, stride_kb, stride_kh, stride_kn, stride_kd,
                       stride_vb, stride_vh, stride_vn, stride_vd, H, M, SAMPLES, PARTS,
                       HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CHUNK: tl.constexpr,
                       NUM_CHUNKS: tl.constexpr, PART: tl.constexpr, TILE: tl.constexpr):
    """Launch 1 of :func:`quantize`, program (p, b*H + h): VAmax[b*H + h, p] (float32 [B*H, PARTS]) = the amax of
    |V| over finite values of keys [p * PART, (p + 1) * PART), TILE at a time; program 0 of a head also writes
    KMean[b, h] (float32 [B, H, D]) = the mean of K's keys (j * M) // SAMPLES, j < SAMPLES
    (:func:`sparsevid.ops.int8.smoothing_tokens`), summed CHUNK at a time."""
    pid_p = tl.program_id(0)
    pid_bh = tl.program_id(1)
    i_b = (pid_bh // H).to(tl.int64)
    i_h = (pid_bh % H).to(tl.int64)
    b_max = tl.zeros([BLOCK_D], dtype=tl.float32)
    for i in tl.static_range(0, PART // TILE):
        p_v, m_tile = _tile_ptrs(V, i_b, i_h, stride_vb, stride_vh, stride_vn, stride_vd, pid_p * PART + i * TILE,
                                 M, TILE, HEAD_DIM, BLOCK_D)
        b_max = tl.maximum(b_max, tl.max(_finite_abs(tl.load(p_v, mask=m_tile, other=0.0).to(tl.float32)), 0))
    tl.store(VAmax + pid_bh.to(tl.int64) * PARTS + pid_p, tl.max(b_max, 0))
    if pid_p == 0:
        o_d = tl.arange(0, BLOCK_D)
        m_d = o_d < HEAD_DIM
        b_sum = tl.zeros([BLOCK_D], dtype=tl.float32)
        for c in tl.static_range(NUM_CHUNKS):
            o_j = c * CHUNK + tl.arange(0, CHUNK)
            o_t = (o_j.to(tl.int64) * M) // SAMPLES
            m_x = (o_j < SAMPLES)[:, None] & m_d[None, :]
            p_x = K + i_b * stride_kb + i_h * stride_kh + o_t[:, None] * stride_kn + o_d[None, :] * stride_kd
            b_sum += tl.sum(tl.load(p_x, mask=m_x, other=0.0).to(tl.float32), 0)
        b_mean = tl.math.div_rn(b_sum, tl.zeros([BLOCK_D], dtype=tl.float32) + SAMPLES)
        tl.store(KMean + pid_bh * HEAD_DIM + o_d, b_mean, mask=m_d)


@triton.jit
def _head_v_scale(VAmax, pid_bh, PARTS, PART_BLOCK: tl.constexpr):
    """The power-of-two e4m3 scale of V's head pid_bh from its chunks' amax (:func:`_int8_stats_kernel`)."""
    b_max = tl.zeros([PART_BLOCK], dtype=tl.float32)
    for first in range(0, PARTS, PART_BLOCK):
        o_p = first + tl.arange(0, PART_BLOCK)
        b_max = tl.maximum(b_max, tl.load(VAmax + pid_bh.to(tl.int64) * PARTS + o_p, mask=o_p < PARTS, other=0.0))
    return _pow2_scale(tl.max(b_max, 0))


@triton.jit
def _int8_kv_block(K, V, KMean, VAmax, K8, V8, KScale, VScale, stride_kb, stride_kh, stride_kn, stride_kd,
                   stride_vb, stride_vh, stride_vn, stride_vd, stride_k8b, stride_k8h, stride_k8n,
                   stride_v8b, stride_v8h, stride_v8d, blk, pid_bh, i_b, i_h, M, PARTS,
                   HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr, PART_BLOCK: tl.constexpr,
                   V_TMA: tl.constexpr):
    """Key block blk of head pid_bh = b*H + h: K minus KMean to int8 K8 with its scale KScale[b, h, blk]; V to
    e4m3 in units of its head's power-of-two scale (VScale[b, h], written by block 0; non-finite values as NaN),
    stored tokens contiguous: V8 is a descriptor over [B, H, D, M] (V_TMA: the accelerator writes the transposed
    tile, keys past M dropped) or the first byte of that layout with unit token stride."""
    start = blk * BLOCK_K
    o_d = tl.arange(0, BLOCK_D)
    b_mean = tl.load(KMean + pid_bh * HEAD_DIM + o_d, mask=o_d < HEAD_DIM, other=0.0)
    p_k, m_tile = _tile_ptrs(K, i_b, i_h, stride_kb, stride_kh, stride_kn, stride_kd, start, M, BLOCK_K, HEAD_DIM,
                             BLOCK_D)
    p_v, _ = _tile_ptrs(V, i_b, i_h, stride_vb, stride_vh, stride_vn, stride_vd, start, M, BLOCK_K, HEAD_DIM,
                        BLOCK_D)
    b_k = tl.where(m_tile, tl.load(p_k, mask=m_tile, other=0.0).to(tl.float32) - b_mean[None, :], 0.0)
    b_v = tl.load(p_v, mask=m_tile, other=0.0).to(tl.float32)
    k_scale = _int8_scale(tl.max(tl.max(_abs_or_zero(b_k), 1), 0), _all_finite(b_k, None))
    v_scale = _head_v_scale(VAmax, pid_bh, PARTS, PART_BLOCK)
    tl.store(KScale + pid_bh.to(tl.int64) * tl.cdiv(M, BLOCK_K) + blk, k_scale)
    if blk == 0:
        tl.store(VScale + pid_bh, v_scale)
    p_k8, _ = _tile_ptrs(K8, i_b, i_h, stride_k8b, stride_k8h, stride_k8n, 1, start, M, BLOCK_K, HEAD_DIM, BLOCK_D)
    tl.store(p_k8, _round_int8(tl.math.div_rn(b_k, tl.zeros_like(b_k) + k_scale)), mask=m_tile)
    b_v8 = _to_fp8(tl.where(tl.abs(b_v) < float("inf"), b_v * tl.math.div_rn(1.0, v_scale), float("nan")))
    if V_TMA:
        V8.store([i_b.to(tl.int32), i_h.to(tl.int32), 0, start], tl.trans(b_v8).reshape(1, 1, HEAD_DIM, BLOCK_K))
    else:
        p_v8, _ = _tile_ptrs(V8, i_b, i_h, stride_v8b, stride_v8h, 1, stride_v8d, start, M, BLOCK_K, HEAD_DIM,
                             BLOCK_D)
        tl.store(p_v8, b_v8, mask=m_tile)


@triton.jit
def _int8_q_rows(Q, KMean, Q8, QScale, QShift, stride_qb, stride_qh, stride_qn, stride_qd, blk, pid_bh, i_b, i_h,
                 N, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, Q_ROWS: tl.constexpr):
    """Query rows [blk * Q_ROWS, (blk + 1) * Q_ROWS) of head pid_bh: int8 Q8 (contiguous [B, H, N, D]) with one
    scale per row (QScale, float32 [B, H, N]) and the rows' q . KMean (QShift, float32 [B, H, N])."""
    o_m = blk * Q_ROWS + tl.arange(0, Q_ROWS)
    o_d = tl.arange(0, BLOCK_D)
    p_q, m_tile = _tile_ptrs(Q, i_b, i_h, stride_qb, stride_qh, stride_qn, stride_qd, blk * Q_ROWS, N, Q_ROWS,
                             HEAD_DIM, BLOCK_D)
    b_q = tl.load(p_q, mask=m_tile, other=0.0).to(tl.float32)
    q_amax = tl.max(_abs_or_zero(b_q), 1)
    p_rows = pid_bh.to(tl.int64) * N + o_m
    tl.store(QScale + p_rows, _int8_scale(q_amax, _all_finite(b_q, 1)), mask=o_m < N)
    b_mean = tl.load(KMean + pid_bh * HEAD_DIM + o_d, mask=o_d < HEAD_DIM, other=0.0)
    tl.store(QShift + p_rows, tl.sum(b_q * b_mean[None, :], 1), mask=o_m < N)
    p_q8 = Q8 + p_rows[:, None] * HEAD_DIM + o_d[None, :]
    tl.store(p_q8, _round_int8(b_q * tl.math.div_rn(tl.zeros_like(q_amax) + _INT8_MAX, q_amax)[:, None]), mask=m_tile)


@triton.jit
def _int8_quant_kernel(Q, K, V, KMean, VAmax, Q8, QScale, QShift, K8, V8, KScale, VScale,
                       stride_qb, stride_qh, stride_qn, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
                       stride_vb, stride_vh, stride_vn, stride_vd, stride_k8b, stride_k8h, stride_k8n,
                       stride_v8b, stride_v8h, stride_v8d, H, N, M, PARTS,
                       HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr, Q_ROWS: tl.constexpr,
                       PART_BLOCK: tl.constexpr, V_TMA: tl.constexpr):
    """Launch 2 of :func:`quantize`, program (j, b*H + h, part): key block j of K and V (part 0,
    :func:`_int8_kv_block`) or query rows block j (part 1, :func:`_int8_q_rows`); programs past their part's
    blocks return."""
    blk = tl.program_id(0)
    pid_bh = tl.program_id(1)
    i_b = (pid_bh // H).to(tl.int64)
    i_h = (pid_bh % H).to(tl.int64)
    if tl.program_id(2) == 0:
        if blk < tl.cdiv(M, BLOCK_K):
            _int8_kv_block(K, V, KMean, VAmax, K8, V8, KScale, VScale, stride_kb, stride_kh, stride_kn, stride_kd,
                           stride_vb, stride_vh, stride_vn, stride_vd, stride_k8b, stride_k8h, stride_k8n,
                           stride_v8b, stride_v8h, stride_v8d, blk, pid_bh, i_b, i_h, M, PARTS, HEAD_DIM, BLOCK_D,
                           BLOCK_K, PART_BLOCK, V_TMA)
    elif blk < tl.cdiv(N, Q_ROWS):
        _int8_q_rows(Q, KMean, Q8, QScale, QShift, stride_qb, stride_qh, stride_qn, stride_qd, blk, pid_bh, i_b, i_h,
                     N, HEAD_DIM, BLOCK_D, Q_ROWS)


def _v_store_by_tma(v8t: torch.Tensor, block_k: int) -> bool:
    """Whether the quantizer writes V's [B, H, D, M] buffer ``v8t`` through a TMA store: with the forward's TMA
    setting, on Hopper or newer, with boxes the accelerator takes (block_k a multiple of 16 up to 256, head dim up
    to 256); the buffer's padded rows keep its strides 16-byte multiples."""
    return (not INTERPRET and "fwd" in bf16.TMA and v8t.is_cuda and bf16._hopper_or_newer(v8t.device.index)
            and block_k % 16 == 0 and block_k <= 256 and v8t.shape[2] <= 256)


def quantize(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_k: int) -> tuple[Int8Queries, Int8Inputs]:
    """The quantized Q (:class:`Int8Queries`), K and V (:class:`Int8Inputs`) of q [B, H, N, D], k, v [B, H, M, D]
    (any strides, float dtypes) in two launches. v8 is a [B, H, M, D] view of a [B, H, D, M'] buffer (M' = M
    rounded up to 16; its padding is never written), so that the kernel reads V with tokens contiguous."""
    b, h, m, d = k.shape
    n = q.shape[2]
    kb = triton.cdiv(m, block_k)
    parts = triton.cdiv(m, _V_PART)
    q8 = bf16._alloc(q, (b, h, n, d), torch.int8)
    q_scale = bf16._alloc(q, (b, h, n), torch.float32)
    q_shift = bf16._alloc(q, (b, h, n), torch.float32)
    k8 = bf16._alloc(k, (b, h, m, d), torch.int8)
    v8t = bf16._alloc(k, (b, h, d, triton.cdiv(m, 16) * 16), FP8_DTYPE)[..., :m]
    k_scale = bf16._alloc(k, (b, h, kb), torch.float32)
    v_scale = bf16._alloc(k, (b, h), torch.float32)
    k_mean = bf16._alloc(k, (b, h, d), torch.float32)
    v_amax = bf16._alloc(k, (b * h, parts), torch.float32)
    samples = min(m, SMOOTH_SAMPLES)
    block_d = bf16.padded_pow2(d)
    _int8_stats_kernel[(parts, b * h)](k, v, k_mean, v_amax, *k.stride(), *v.stride(), h, m, samples, parts,
                                       HEAD_DIM=d, BLOCK_D=block_d, CHUNK=_SMOOTH_CHUNK,
                                       NUM_CHUNKS=triton.cdiv(samples, _SMOOTH_CHUNK), PART=_V_PART, TILE=_V_TILE,
                                       num_warps=4)
    v_tma = _v_store_by_tma(v8t, block_k)
    v8_dest = TensorDescriptor.from_tensor(v8t, [1, 1, d, block_k]) if v_tma else v8t
    _int8_quant_kernel[(max(kb, triton.cdiv(n, _Q_ROWS)), b * h, 2)](
        q, k, v, k_mean, v_amax, q8, q_scale, q_shift, k8, v8_dest, k_scale, v_scale, *q.stride(), *k.stride(),
        *v.stride(), *k8.stride()[:3], v8t.stride(0), v8t.stride(1), v8t.stride(2), h, n, m, parts, HEAD_DIM=d,
        BLOCK_D=block_d, BLOCK_K=block_k, Q_ROWS=_Q_ROWS, PART_BLOCK=_PART_BLOCK, V_TMA=v_tma, num_warps=4)
    return Int8Queries(q8, q_scale, q_shift), Int8Inputs(k8, v8t.transpose(-1, -2), k_scale, v_scale, k_mean)


# --------------------------------------------------------------------------- attention

@triton.jit
def _int8_logits(b_q8, k_src, start_n, stride_kn, o_d, M, i_b, i_h, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                 SUB_N: tl.constexpr, MASK_COLS: tl.constexpr, USE_TMA: tl.constexpr):
    """Q K^T of keys [start_n, start_n + SUB_N) on int8 tensor cores, converted to float32 [ROWS, SUB_N] (exact:
    |logit| <= 127^2 * D < 2^24); columns past M at -inf where MASK_COLS."""
    b_kt = _load_rows(k_src, start_n, stride_kn, o_d, M, HEAD_DIM, BLOCK_D, SUB_N, MASK_COLS, True, USE_TMA,
                      i_b, i_h)
    b_f = tl.dot(b_q8, b_kt, out_dtype=tl.int32).to(tl.float32)
    if MASK_COLS:
        b_f = tl.where((start_n + tl.arange(0, SUB_N) < M)[None, :], b_f, -float("inf"))
    return b_f


@triton.jit
def _int8_pair(b_acc, b_pv, b_fold, b_m, b_l, b_q8, rs_a, rs_b, k_src, v_src, start_a, start_b, stride_kn,
               stride_vd, o_d, M, i_b, i_h, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SUB_N: tl.constexpr,
               USE_TMA: tl.constexpr):
    """Two whole kept sub-tiles (keys from start_a and from start_b) in one step. rs_a, rs_b (float32 [ROWS]): q's
    row scale times each tile's k scale, the softmax scale and log2(e), applied inside the exponential's FMA. b_m is
    the running max minus log2(P_SCALE), so exp2 gives P * P_SCALE, cast to fp8 as it is. One row max per pair.

    The output so far is b_acc * b_fold + b_pv: b_pv (float32 [ROWS, D]) is the last step's P V product, which the
    tensor cores summed from zero (128 keys: short enough for their reduced-precision accumulation), and b_fold
    (float32 [ROWS]) the rescale it came with. It is folded into b_acc by one FMA after this step's logits, so its
    MMA runs while they are computed. Returns b_acc, b_pv, b_fold, b_m and b_l in those terms."""
    b_fa = _int8_logits(b_q8, k_src, start_a, stride_kn, o_d, M, i_b, i_h, HEAD_DIM, BLOCK_D, SUB_N, False, USE_TMA)
    b_fb = _int8_logits(b_q8, k_src, start_b, stride_kn, o_d, M, i_b, i_h, HEAD_DIM, BLOCK_D, SUB_N, False, USE_TMA)
    b_va = _load_v(v_src, start_a, stride_vd, o_d, M, HEAD_DIM, BLOCK_D, SUB_N, False, USE_TMA, i_b, i_h)
    b_vb = _load_v(v_src, start_b, stride_vd, o_d, M, HEAD_DIM, BLOCK_D, SUB_N, False, USE_TMA, i_b, i_h)
    b_m_new = tl.maximum(b_m, tl.maximum(tl.max(b_fa, 1) * rs_a, tl.max(b_fb, 1) * rs_b) - _LOG2_P_SCALE)
    b_pa = tl.math.exp2(tl.fma(b_fa, rs_a[:, None], -b_m_new[:, None]))
    b_pb = tl.math.exp2(tl.fma(b_fb, rs_b[:, None], -b_m_new[:, None]))
    b_alpha = tl.math.exp2(b_m - b_m_new)
    b_l = b_l * b_alpha + tl.sum(b_pa, 1) + tl.sum(b_pb, 1)
    b_acc = tl.fma(b_acc, b_fold[:, None], b_pv)
    b_pv = tl.dot(b_pb.to(tl.float8e4nv), b_vb, tl.dot(b_pa.to(tl.float8e4nv), b_va))
    return b_acc, b_pv, b_alpha, b_m_new, b_l


@triton.jit
def _int8_single(b_acc, b_pv, b_fold, b_m, b_l, b_q8, b_rs, k_src, v_src, start_n, stride_kn, stride_vd, o_d, M,
                 i_b, i_h, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SUB_N: tl.constexpr,
                 MASK_COLS: tl.constexpr, USE_TMA: tl.constexpr):
    """One kept sub-tile (the odd one of a row's pairs, or a sub-tile of the sequence's short last block; keys past
    M weigh 0 where MASK_COLS), as :func:`_int8_pair` does two."""
    b_f = _int8_logits(b_q8, k_src, start_n, stride_kn, o_d, M, i_b, i_h, HEAD_DIM, BLOCK_D, SUB_N, MASK_COLS,
                       USE_TMA)
    b_v = _load_v(v_src, start_n, stride_vd, o_d, M, HEAD_DIM, BLOCK_D, SUB_N, MASK_COLS, USE_TMA, i_b, i_h)
    b_m_new = tl.maximum(b_m, tl.max(b_f, 1) * b_rs - _LOG2_P_SCALE)
    b_p = tl.math.exp2(tl.fma(b_f, b_rs[:, None], -b_m_new[:, None]))
    if MASK_COLS:
        b_p = tl.where((start_n + tl.arange(0, SUB_N) < M)[None, :], b_p, 0.0)
    b_alpha = tl.math.exp2(b_m - b_m_new)
    b_l = b_l * b_alpha + tl.sum(b_p, 1)
    b_acc = tl.fma(b_acc, b_fold[:, None], b_pv)
    return b_acc, tl.dot(b_p.to(tl.float8e4nv), b_v), b_alpha, b_m_new, b_l


# Two kept sub-tiles per step (benchmarks/int8_kernel_limits.py, "pairs"): 64-row programs of 4 warps, 3 stages won;
# with the pair's fresh product they take 250 registers (two programs per SM, as the 200 without it).
# Interpreted with 64-key sub-tiles: one per 64-key block (rows with an odd count take the single-tile step), two
# per 128-key block.
@triton.autotune(configs=_configs("ROWS", "SUB_N", ((64, 64, 4, 3), (64, 64, 4, 2), (64, 64, 4, 4),
                                                   (128, 64, 8, 2)), _box_hook,
                                  interpreted=(64, 64, 4, 1)),
                 key=["HEAD_DIM", "BLOCK_M", "BLOCK_N", "N", "M", "USE_TMA"],
                 prune_configs_by=_prune("ROWS", "BLOCK_M", "SUB_N", "BLOCK_N"))
@triton.jit
def _bsa_int8_fwd_kernel(Q8, QScale, QShift, K, V, KScale, VScale, Out, Lse, KvCount, KvIndex,
                         stride_qb, stride_qh, stride_qn,
                         stride_kb, stride_kh, stride_kn,
                         stride_vb, stride_vh, stride_vd,
                         stride_ob, stride_oh, stride_on, stride_od,
                         stride_cb, stride_ch, stride_ib, stride_ih, stride_ir,
                         H, N, M, NUM_Q_BLOCKS, NUM_KV_BLOCKS, scale_log2,
                         HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, ROWS: tl.constexpr, SUB_N: tl.constexpr, USE_TMA: tl.constexpr):
    """Forward over the kept tiles of ROWS query rows (inside one query block) of int8 Q8 [B, H, N, D] (unit
    head-dim stride) with its row scales QScale and smoothing shifts QShift (float32 [B, H, N]), K8 with its block
    scales KScale (float32 [B, H, NUM_KV_BLOCKS]) and V8 in units of its head's scale VScale (float32 [B, H])."""
    _, pid_bh, i_b, i_h, q_block, o_m, o_d, m_tile = _program_rows(H, N, HEAD_DIM, BLOCK_D, BLOCK_M, ROWS)
    m_rows = o_m < N
    p_q = Q8 + i_b * stride_qb + i_h * stride_qh + o_m[:, None].to(tl.int64) * stride_qn + o_d[None, :]
    b_q8 = tl.load(p_q, mask=m_tile, other=0)
    p_rows = pid_bh.to(tl.int64) * N + o_m
    b_rs = tl.load(QScale + p_rows, mask=m_rows, other=1.0) * scale_log2
    # Smoothing takes q . k_mean off every logit of a row (base 2 here): the log-sum-exp gets it back.
    b_shift = tl.load(QShift + p_rows, mask=m_rows, other=0.0) * scale_log2
    p_kscale = KScale + pid_bh.to(tl.int64) * NUM_KV_BLOCKS
    k_src = _rows_source(K, i_b, i_h, stride_kb, stride_kh, USE_TMA)
    v_src = _rows_source(V, i_b, i_h, stride_vb, stride_vh, USE_TMA)

    _, p_index, num_full, ragged_tail, last_block = _tile_schedule(
        KvCount, KvIndex, i_b, i_h, q_block, stride_cb, stride_ch, stride_ib, stride_ih, stride_ir, NUM_KV_BLOCKS, M,
        BLOCK_N)

    SUBS: tl.constexpr = BLOCK_N // SUB_N
    num_subs = num_full * SUBS  # whole kept sub-tiles, taken two at a time
    b_m = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([ROWS], dtype=tl.float32)
    b_acc = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
    b_pv = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)  # the output is b_acc * b_fold + b_pv (see _int8_pair)
    b_fold = tl.full([ROWS], 1.0, dtype=tl.float32)
    for it in range(0, num_subs // 2):
        block_a = tl.load(p_index + (2 * it) // SUBS)
        block_b = tl.load(p_index + (2 * it + 1) // SUBS)
        b_acc, b_pv, b_fold, b_m, b_l = _int8_pair(
            b_acc, b_pv, b_fold, b_m, b_l, b_q8, b_rs * tl.load(p_kscale + block_a),
            b_rs * tl.load(p_kscale + block_b), k_src, v_src, block_a * BLOCK_N + ((2 * it) % SUBS) * SUB_N,
            block_b * BLOCK_N + ((2 * it + 1) % SUBS) * SUB_N, stride_kn, stride_vd, o_d, M, i_b, i_h, HEAD_DIM,
            BLOCK_D, SUB_N, USE_TMA)
    if num_subs % 2 == 1:
        block = tl.load(p_index + (num_subs - 1) // SUBS)
        b_acc, b_pv, b_fold, b_m, b_l = _int8_single(
            b_acc, b_pv, b_fold, b_m, b_l, b_q8, b_rs * tl.load(p_kscale + block), k_src, v_src,
            block * BLOCK_N + ((num_subs - 1) % SUBS) * SUB_N, stride_kn, stride_vd, o_d, M, i_b, i_h, HEAD_DIM,
            BLOCK_D, SUB_N, False, USE_TMA)
    if ragged_tail:
        b_tile_rs = b_rs * tl.load(p_kscale + last_block)
        for sub in range(0, SUBS):
            start_n = last_block * BLOCK_N + sub * SUB_N
            if start_n < M:
                b_acc, b_pv, b_fold, b_m, b_l = _int8_single(
                    b_acc, b_pv, b_fold, b_m, b_l, b_q8, b_tile_rs, k_src, v_src, start_n, stride_kn, stride_vd, o_d,
                    M, i_b, i_h, HEAD_DIM, BLOCK_D, SUB_N, True, USE_TMA)

    p_o = Out + i_b * stride_ob + i_h * stride_oh + o_m[:, None].to(tl.int64) * stride_on + o_d[None, :] * stride_od
    # VScale is a power of two: scaling by it first is exact
    b_out = tl.fma(b_acc, b_fold[:, None], b_pv) * tl.load(VScale + pid_bh)
    _store_rows(p_o, Lse + p_rows, b_out, b_m, b_l, b_shift, m_tile, m_rows)


def int8_forward(qx: Int8Queries, x: Int8Inputs, kv_count: torch.Tensor, kv_index: torch.Tensor, block_q: int,
                 block_k: int, scale: float, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward of quantized Q ``qx`` over quantized K and V ``x`` (from :func:`quantize`, or any
    :class:`Int8Queries` and :class:`Int8Inputs` whose q8 and k8 have unit head-dim stride and v8 unit token
    stride). Returns out [B, H, N, D] with the dtype and layout of ``like`` (the unquantized q) and lse float32
    [B, H, N] (natural log)."""
    if qx.q8.stride(-1) != 1 or x.v8.stride(2) != 1 or x.k8.stride(-1) != 1:
        raise ValueError("int8_forward needs q8 and k8 with unit head-dim stride and v8 with unit token stride (as "
                         "made by quantize)")
    b, h, n, d = qx.q8.shape
    m = x.k8.shape[2]
    out = bf16._alloc(like)
    lse = bf16._alloc(like, (b, h, n), torch.float32)
    vt = x.v8.transpose(-1, -2)  # [B, H, D, M], tokens contiguous
    use_tma = bf16._use_tma("fwd", x.k8, vt)
    k_src, v_src = ((TensorDescriptor.from_tensor(x.k8, [1, 1, 16, d]), TensorDescriptor.from_tensor(vt, [1, 1, d, 16]))
                    if use_tma else (x.k8, vt))
    launch_tuned(
        _bsa_int8_fwd_kernel, lambda meta: (triton.cdiv(n, meta["ROWS"]), b * h), (n, m, like.dtype, like.device),
        qx.q8, qx.q_scale.contiguous(), qx.q_shift.contiguous(), k_src, v_src, x.k_scale, x.v_scale.contiguous(), out,
        lse, kv_count, kv_index, *qx.q8.stride()[:3], *x.k8.stride()[:3], *vt.stride()[:3], *out.stride(),
        *bf16._table_strides(kv_count, kv_index, b, h),
        h, n, m, triton.cdiv(n, block_q), x.k_scale.shape[2], scale * LOG2E,
        HEAD_DIM=d, BLOCK_D=bf16.padded_pow2(d), BLOCK_M=block_q, BLOCK_N=block_k, USE_TMA=use_tma,
    )
    return out, lse


def triton_int8_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_count: torch.Tensor,
                          kv_index: torch.Tensor, block_q: int, block_k: int,
                          scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize` then :func:`int8_forward`. q: [B, H, N, D], k, v: [B, H, M, D]; returns out
    [B, H, N, D] (q's dtype and layout) and lse float32 [B, H, N]."""
    qx, x = quantize(q, k, v, block_k)
    return int8_forward(qx, x, kv_count, kv_index, block_q, block_k, scale, q)
