"""FP8 (e4m3) block-sparse attention forward in Triton, for GPUs with FP8 tensor cores (sm89, sm90+).

Two steps: :func:`quantize` (K's mean and V's channel scales in one launch, then Q (two terms), K and V scaled,
cast and stored in another; V is stored with tokens contiguous, the layout an FP8 tensor-core product needs for
its right operand) and :func:`fp8_forward`, the bf16 forward's online softmax with every product on fp8 operands
and fp32 accumulation. The scaling rules are in :mod:`sparsevid.ops.fp8`; the PyTorch oracle is
:mod:`sparsevid.ops.fp8_reference`. Forward only (inference).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from . import triton_attention as bf16
from .fp8 import FP8_DTYPE, FP8_MAX, P_SCALE, Fp8Inputs
from .triton_attention import (LOG2E, _configs, _load_rows, _prune, _program_rows, _rows_source, _store_rows,
                               _tile_schedule)
from .triton_launch import launch_tuned

_FP8_MAX = tl.constexpr(FP8_MAX)
_LOG2_P_SCALE = tl.constexpr(math.log2(P_SCALE))


# --------------------------------------------------------------------------- quantization

_QUANT_TILE = 64  # tokens of V a quantizer program transposes; the statistics' load step
_STATS_CHUNK = 256  # tokens of K and V one statistics program reads (4 loads of _QUANT_TILE, issued together)


@triton.jit
def _pow2_scale(amax):
    """:func:`sparsevid.ops.fp8.scale_from_amax` on float32 amax >= 0 (scalar or tile): 2^s, the smallest s in
    [-126, 127] with amax / 2^s <= 448, from the exponent and mantissa bits; 1 where amax is 0."""
    bits = amax.to(tl.int32, bitcast=True)
    s = ((bits >> 23) & 0xFF) - 135 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    s = tl.minimum(tl.maximum(s, -126), 127)
    return tl.where(amax == 0, 1.0, ((s + 127) << 23).to(tl.float32, bitcast=True))


@triton.jit
def _abs_or_zero(b_x):
    """|x|, NaN as 0 (a scale ignores NaN; the NaN element stays NaN in its own fp8 value)."""
    return tl.where(b_x == b_x, tl.abs(b_x), 0.0)


@triton.jit
def _to_fp8(b_y):
    """float32 y (already scaled) clamped to +-448 (NaN kept) and rounded to e4m3."""
    return tl.clamp(b_y, -_FP8_MAX, _FP8_MAX, propagate_nan=tl.PropagateNan.ALL).to(tl.float8e4nv)


@triton.jit
def _tile_ptrs(X, i_b, i_h, stride_b, stride_h, stride_n, stride_d, start, T, BLOCK: tl.constexpr,
               HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Pointers to tokens [start, start + BLOCK) of one head of a [B, H, T, D] tensor, and their bounds mask."""
    o_t = start + tl.arange(0, BLOCK)
    o_d = tl.arange(0, BLOCK_D)
    ptrs = X + i_b * stride_b + i_h * stride_h + o_t[:, None].to(tl.int64) * stride_n + o_d[None, :] * stride_d
    return ptrs, (o_t < T)[:, None] & (o_d < HEAD_DIM)[None, :]


@triton.jit
def _fp8_stats_kernel(K, V, Partial, Counter, KMean, VScale, stride_kb, stride_kh, stride_kn, stride_kd,
                      stride_vb, stride_vh, stride_vn, stride_vd, H, M, PARTS,
                      HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, TILE: tl.constexpr, CHUNK: tl.constexpr,
                      PART_BLOCK: tl.constexpr):
    """Launch 1 of :func:`quantize`: program (p, b*H + h) reads tokens [p*CHUNK, (p+1)*CHUNK) of K and V
    [B, H, M, D] and writes K's column sum and |V|'s column amax (NaN ignored) there to Partial[b*H + h, 0 / 1, p]
    (float32 [B*H, 2, PARTS, D]). The last program of a head to finish (a ticket from Counter, int32 [B*H],
    zeros) reduces the partials in a fixed order into KMean (the mean) and VScale (the power-of-two scale)."""
    pid_p = tl.program_id(0)
    pid_bh = tl.program_id(1)
    i_b = (pid_bh // H).to(tl.int64)
    i_h = (pid_bh % H).to(tl.int64)
    b_sum = tl.zeros([BLOCK_D], dtype=tl.float32)
    b_max = tl.zeros([BLOCK_D], dtype=tl.float32)
    for i in tl.static_range(0, CHUNK // TILE):
        start = pid_p * CHUNK + i * TILE
        p_k, m_tile = _tile_ptrs(K, i_b, i_h, stride_kb, stride_kh, stride_kn, stride_kd, start, M, TILE,
                                 HEAD_DIM, BLOCK_D)
        p_v, _ = _tile_ptrs(V, i_b, i_h, stride_vb, stride_vh, stride_vn, stride_vd, start, M, TILE,
                            HEAD_DIM, BLOCK_D)
        b_sum += tl.sum(tl.load(p_k, mask=m_tile, other=0.0).to(tl.float32), 0)
        b_max = tl.maximum(b_max, tl.max(_abs_or_zero(tl.load(p_v, mask=m_tile, other=0.0).to(tl.float32)), 0))
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < HEAD_DIM
    p_head = Partial + pid_bh.to(tl.int64) * 2 * PARTS * HEAD_DIM
    tl.store(p_head + pid_p * HEAD_DIM + o_d, b_sum, mask=m_d)
    tl.store(p_head + (PARTS + pid_p) * HEAD_DIM + o_d, b_max, mask=m_d)
    # Every thread's partials are stored before the ticket's release (one thread takes the ticket); the last
    # program reads the others' partials from L2 (.cg) after its acquire.
    tl.debug_barrier()
    if tl.atomic_add(Counter + pid_bh, 1, sem="acq_rel") == PARTS - 1:
        b_sum = tl.zeros([BLOCK_D], dtype=tl.float32)
        b_max = tl.zeros([BLOCK_D], dtype=tl.float32)
        for first in range(0, PARTS, PART_BLOCK):
            o_p = first + tl.arange(0, PART_BLOCK)
            m_p = (o_p < PARTS)[:, None] & m_d[None, :]
            p_part = p_head + o_p[:, None] * HEAD_DIM + o_d[None, :]
            b_sum += tl.sum(tl.load(p_part, mask=m_p, other=0.0, cache_modifier=".cg"), 0)
            b_max = tl.maximum(b_max, tl.max(tl.load(p_part + PARTS * HEAD_DIM, mask=m_p, other=0.0,
                                                     cache_modifier=".cg"), 0))
        b_mean = tl.math.div_rn(b_sum, tl.zeros([BLOCK_D], dtype=tl.float32) + M)
        tl.store(KMean + pid_bh * HEAD_DIM + o_d, b_mean, mask=m_d)
        tl.store(VScale + pid_bh * HEAD_DIM + o_d, _pow2_scale(b_max), mask=m_d)


@triton.jit
def _quantize_block(X, Out, OutLo, Scale, b_mean, i_b, i_h, pid_bh, blk, T,
                    stride_xb, stride_xh, stride_xn, stride_xd, stride_ob, stride_oh, stride_on,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK: tl.constexpr, RESIDUAL: tl.constexpr):
    """Block blk of BLOCK tokens of one head of X: (x - b_mean) with one power-of-two scale (into Scale,
    [B*H, ceil(T / BLOCK)]) to fp8 in Out (unit head-dim stride); with RESIDUAL, the rounded residual
    x / scale - Out (exact in float32) to OutLo (Out's strides)."""
    p_x, m_tile = _tile_ptrs(X, i_b, i_h, stride_xb, stride_xh, stride_xn, stride_xd, blk * BLOCK, T, BLOCK,
                             HEAD_DIM, BLOCK_D)
    b_x = tl.where(m_tile, tl.load(p_x, mask=m_tile, other=0.0).to(tl.float32) - b_mean[None, :], 0.0)
    scale = _pow2_scale(tl.max(tl.max(_abs_or_zero(b_x), 1), 0))
    tl.store(Scale + pid_bh.to(tl.int64) * tl.cdiv(T, BLOCK) + blk, scale)
    p_o, _ = _tile_ptrs(Out, i_b, i_h, stride_ob, stride_oh, stride_on, 1, blk * BLOCK, T, BLOCK, HEAD_DIM, BLOCK_D)
    b_y = b_x * tl.math.div_rn(1.0, scale)
    b_y8 = _to_fp8(b_y)
    tl.store(p_o, b_y8, mask=m_tile)
    if RESIDUAL:
        p_lo, _ = _tile_ptrs(OutLo, i_b, i_h, stride_ob, stride_oh, stride_on, 1, blk * BLOCK, T, BLOCK, HEAD_DIM,
                             BLOCK_D)
        tl.store(p_lo, _to_fp8(b_y - b_y8.to(tl.float32)), mask=m_tile)


@triton.jit
def _fp8_quant_kernel(Q, K, V, Q8, Q8Lo, K8, V8, QScale, KScale, VScale, KMean,
                      stride_qb, stride_qh, stride_qn, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
                      stride_vb, stride_vh, stride_vn, stride_vd, stride_q8b, stride_q8h, stride_q8n,
                      stride_k8b, stride_k8h, stride_k8n, stride_v8b, stride_v8h, stride_v8d, H, N, M,
                      HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
                      TILE: tl.constexpr):
    """Launch 2 of :func:`quantize`: program (p, b*H + h, role) quantizes block p of one head of Q (role 0,
    BLOCK_Q tokens, its own scale, two terms: Q8 and the residual Q8Lo), of K smoothed by KMean (role 1, BLOCK_K
    tokens, its own scale) or TILE tokens of V by VScale (role 2; V8 has unit token stride); programs past their
    tensor's end do nothing."""
    pid_p = tl.program_id(0)
    pid_bh = tl.program_id(1)
    role = tl.program_id(2)
    i_b = (pid_bh // H).to(tl.int64)
    i_h = (pid_bh % H).to(tl.int64)
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < HEAD_DIM
    p_stat = pid_bh * HEAD_DIM + o_d
    if role == 0:
        if pid_p * BLOCK_Q < N:
            _quantize_block(Q, Q8, Q8Lo, QScale, tl.zeros([BLOCK_D], dtype=tl.float32), i_b, i_h, pid_bh, pid_p, N,
                            stride_qb, stride_qh, stride_qn, stride_qd, stride_q8b, stride_q8h, stride_q8n,
                            HEAD_DIM, BLOCK_D, BLOCK_Q, True)
    elif role == 1:
        if pid_p * BLOCK_K < M:
            _quantize_block(K, K8, K8, KScale, tl.load(KMean + p_stat, mask=m_d, other=0.0), i_b, i_h, pid_bh,
                            pid_p, M, stride_kb, stride_kh, stride_kn, stride_kd, stride_k8b, stride_k8h, stride_k8n,
                            HEAD_DIM, BLOCK_D, BLOCK_K, False)
    elif pid_p * TILE < M:
        b_inv = tl.math.div_rn(tl.full([BLOCK_D], 1.0, dtype=tl.float32),
                               tl.load(VScale + p_stat, mask=m_d, other=1.0))
        p_v, m_tile = _tile_ptrs(V, i_b, i_h, stride_vb, stride_vh, stride_vn, stride_vd, pid_p * TILE, M, TILE,
                                 HEAD_DIM, BLOCK_D)
        b_v8 = _to_fp8(tl.load(p_v, mask=m_tile, other=0.0).to(tl.float32) * b_inv[None, :])
        p_o, _ = _tile_ptrs(V8, i_b, i_h, stride_v8b, stride_v8h, 1, stride_v8d, pid_p * TILE, M, TILE, HEAD_DIM,
                            BLOCK_D)
        tl.store(p_o, b_v8, mask=m_tile)


def quantize(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_q: int, block_k: int) -> Fp8Inputs:
    """The FP8 inputs (:class:`Fp8Inputs`) of q [B, H, N, D], k, v [B, H, M, D] (any strides, float dtypes)
    in three launches: a zeroed ticket counter, K's mean and V's channel scales (:func:`_fp8_stats_kernel`),
    then Q, K and V quantized one block per program. v8 is a [B, H, M, D] view of a [B, H, D, M'] buffer (M' = M
    rounded up to 16; its padding is never written), so that the kernel reads V with tokens contiguous."""
    b, h, n, d = q.shape
    m = k.shape[2]
    parts = triton.cdiv(m, _STATS_CHUNK)
    q8 = bf16._alloc(q, (b, h, n, d), FP8_DTYPE)
    q8_lo = bf16._alloc(q, (b, h, n, d), FP8_DTYPE)
    k8 = bf16._alloc(q, (b, h, m, d), FP8_DTYPE)
    v8 = bf16._alloc(q, (b, h, d, triton.cdiv(m, 16) * 16), FP8_DTYPE)[..., :m].transpose(-1, -2)
    q_scale = bf16._alloc(q, (b, h, triton.cdiv(n, block_q)), torch.float32)
    k_scale = bf16._alloc(q, (b, h, triton.cdiv(m, block_k)), torch.float32)
    v_scale = bf16._alloc(q, (b, h, d), torch.float32)
    k_mean = bf16._alloc(q, (b, h, d), torch.float32)
    partial = bf16._alloc(q, (b * h, 2, parts, d), torch.float32)
    counter = torch.zeros(b * h, device=q.device, dtype=torch.int32)
    meta = dict(HEAD_DIM=d, BLOCK_D=bf16.padded_pow2(d), TILE=_QUANT_TILE)
    _fp8_stats_kernel[(parts, b * h)](k, v, partial, counter, k_mean, v_scale, *k.stride(), *v.stride(), h, m,
                                      parts, **meta, CHUNK=_STATS_CHUNK, PART_BLOCK=32, num_warps=4)
    blocks = max(triton.cdiv(n, block_q), triton.cdiv(m, min(block_k, _QUANT_TILE)))
    _fp8_quant_kernel[(blocks, b * h, 3)](
        q, k, v, q8, q8_lo, k8, v8, q_scale, k_scale, v_scale, k_mean, *q.stride(), *k.stride(), *v.stride(),
        *q8.stride()[:3], *k8.stride()[:3], v8.stride(0), v8.stride(1), v8.stride(3), h, n, m,
        **meta, BLOCK_Q=block_q, BLOCK_K=block_k, num_warps=8 if max(block_q, block_k) * d >= 128 * 128 else 4,
    )
    return Fp8Inputs(q8, q8_lo, k8, v8, q_scale, k_scale, v_scale, k_mean)


# --------------------------------------------------------------------------- attention


def _box_hook(args: dict) -> None:
    """Autotuning pre-hook: with tensor descriptors, K's box becomes [1, 1, SUB_N, D] and V's (over the
    [B, H, D, M] layout) [1, 1, D, SUB_N]."""
    if isinstance(args["K"], TensorDescriptor):
        sub = args["SUB_N"]
        args["K"].block_shape = [1, 1, sub, args["K"].block_shape[-1]]
        args["V"].block_shape = [1, 1, args["V"].block_shape[-2], sub]


@triton.jit
def _load_v(source, start, stride_vd, o_d, M, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SUB: tl.constexpr,
            MASK_COLS: tl.constexpr, USE_TMA: tl.constexpr, i_b, i_h):
    """Keys [start, start + SUB) of V as [SUB, BLOCK_D], read from V's tokens-contiguous layout (a descriptor
    over [B, H, D, M], or pointers with unit token stride) and transposed in shared memory; keys past M and
    channels past HEAD_DIM read as zero."""
    if USE_TMA:
        b_vt = source.load([i_b.to(tl.int32), i_h.to(tl.int32), 0, start]).reshape(HEAD_DIM, SUB)
    else:
        o_n = start + tl.arange(0, SUB)
        ptrs = source + o_d[:, None].to(tl.int64) * stride_vd + o_n[None, :]
        m_d = (o_d < HEAD_DIM)[:, None]
        if MASK_COLS:
            b_vt = tl.load(ptrs, mask=m_d & (o_n < M)[None, :], other=0.0)
        elif HEAD_DIM != BLOCK_D:
            b_vt = tl.load(ptrs, mask=m_d, other=0.0)
        else:
            b_vt = tl.load(ptrs)
    return tl.trans(b_vt)


@triton.jit
def _fp8_tile(b_acc, b_m, b_l, b_q, b_q_lo, k_src, v_src, start_n, tile_scale, stride_kn, stride_vd, o_d, M, i_b, i_h,
              HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SUB_N: tl.constexpr, MASK_COLS: tl.constexpr,
              USE_TMA: tl.constexpr):
    """SUB_N keys of a kept tile. Both terms of Q (b_q, b_q_lo) times K accumulate into one fp32 tile;
    tile_scale = q_scale * k_scale * softmax scale * log2(e) (> 0) turns it into base-2 logits s; b_m is the
    running max of s minus log2(P_SCALE), so exp2(s - b_m) (one FMA and an exp2 per logit) is P * P_SCALE, cast
    to fp8 as it is, and b_l sums it (P_SCALE cancels in out = acc / l)."""
    b_kt = _load_rows(k_src, start_n, stride_kn, o_d, M, HEAD_DIM, BLOCK_D, SUB_N, MASK_COLS, True, USE_TMA,
                      i_b, i_h)
    b_v = _load_v(v_src, start_n, stride_vd, o_d, M, HEAD_DIM, BLOCK_D, SUB_N, MASK_COLS, USE_TMA, i_b, i_h)
    b_s = tl.dot(b_q_lo, b_kt, tl.dot(b_q, b_kt))
    if MASK_COLS:
        b_s = tl.where((start_n + tl.arange(0, SUB_N) < M)[None, :], b_s, float("-inf"))
    b_m_new = tl.maximum(b_m, tl.max(b_s, 1) * tile_scale - _LOG2_P_SCALE)
    b_p = tl.math.exp2(tl.fma(b_s, tile_scale, -b_m_new[:, None]))
    b_alpha = tl.math.exp2(b_m - b_m_new)
    b_l = b_l * b_alpha + tl.sum(b_p, 1)
    # Hopper's fp8 MMA accumulates in reduced precision: each tile's product starts from zero and is added to the
    # fp32 accumulator by the rescale's FMA (as in the int8 forward, whose comment says why not Triton's own
    # promotion).
    b_acc = tl.fma(b_acc, b_alpha[:, None], tl.dot(b_p.to(tl.float8e4nv), b_v))
    return b_acc, b_m_new, b_l


# No 128-row 4-warp config: with Q's two terms ptxas (sm_90) spills 2 KB there; 8 warps spill 36 bytes, 64 rows none.
@triton.autotune(configs=_configs("ROWS", "SUB_N", ((128, 64, 8, 2), (128, 64, 8, 3), (128, 64, 8, 4),
                                                   (128, 128, 8, 2), (128, 128, 8, 3), (64, 64, 4, 3),
                                                   (64, 64, 4, 4)), _box_hook),
                 key=["HEAD_DIM", "BLOCK_M", "BLOCK_N", "N", "M", "USE_TMA"],
                 prune_configs_by=_prune("ROWS", "BLOCK_M", "SUB_N", "BLOCK_N"))
@triton.jit
def _bsa_fp8_fwd_kernel(Q, QLo, K, V, QScale, KScale, VScale, KMean, Out, Lse, KvCount, KvIndex,
                        stride_qb, stride_qh, stride_qn,
                        stride_kb, stride_kh, stride_kn,
                        stride_vb, stride_vh, stride_vd,
                        stride_ob, stride_oh, stride_on, stride_od,
                        stride_cb, stride_ch, stride_ib, stride_ih, stride_ir,
                        H, N, M, NUM_Q_BLOCKS, NUM_KV_BLOCKS, scale_log2,
                        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, ROWS: tl.constexpr, SUB_N: tl.constexpr, USE_TMA: tl.constexpr):
    """Forward over the kept tiles of ROWS query rows (inside one query block, hence one q scale); Q and QLo
    (Q's residual) share strides."""
    _, pid_bh, i_b, i_h, q_block, o_m, o_d, m_tile = _program_rows(H, N, HEAD_DIM, BLOCK_D, BLOCK_M, ROWS)
    m_d = o_d < HEAD_DIM

    o_q = i_b * stride_qb + i_h * stride_qh + o_m[:, None].to(tl.int64) * stride_qn + o_d[None, :]
    b_q = tl.load(Q + o_q, mask=m_tile, other=0.0)
    b_q_lo = tl.load(QLo + o_q, mask=m_tile, other=0.0)
    q_scale = tl.load(QScale + pid_bh.to(tl.int64) * NUM_Q_BLOCKS + q_block)
    qk_scale = q_scale * scale_log2
    # Smoothing takes q . k_mean off every logit of a row (base 2 here): the log-sum-exp gets it back.
    b_mean = tl.load(KMean + pid_bh * HEAD_DIM + o_d, mask=m_d, other=0.0)
    b_shift = tl.sum((b_q.to(tl.float32) + b_q_lo.to(tl.float32)) * b_mean[None, :], 1) * qk_scale
    p_kscale = KScale + pid_bh.to(tl.int64) * NUM_KV_BLOCKS
    k_src = _rows_source(K, i_b, i_h, stride_kb, stride_kh, USE_TMA)
    v_src = _rows_source(V, i_b, i_h, stride_vb, stride_vh, USE_TMA)

    _, p_index, num_full, ragged_tail, last_block = _tile_schedule(
        KvCount, KvIndex, i_b, i_h, q_block, stride_cb, stride_ch, stride_ib, stride_ih, stride_ir, NUM_KV_BLOCKS, M,
        BLOCK_N)

    SUBS: tl.constexpr = BLOCK_N // SUB_N
    b_m = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([ROWS], dtype=tl.float32)
    b_acc = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
    for it in range(0, num_full * SUBS):
        kv_block = tl.load(p_index + it // SUBS)
        b_acc, b_m, b_l = _fp8_tile(b_acc, b_m, b_l, b_q, b_q_lo, k_src, v_src,
                                    kv_block * BLOCK_N + (it % SUBS) * SUB_N, tl.load(p_kscale + kv_block) * qk_scale,
                                    stride_kn, stride_vd, o_d, M, i_b, i_h, HEAD_DIM, BLOCK_D, SUB_N, False, USE_TMA)
    if ragged_tail:
        tile_scale = tl.load(p_kscale + last_block) * qk_scale
        for sub in range(0, SUBS):
            start_n = last_block * BLOCK_N + sub * SUB_N
            if start_n < M:
                b_acc, b_m, b_l = _fp8_tile(b_acc, b_m, b_l, b_q, b_q_lo, k_src, v_src, start_n, tile_scale, stride_kn,
                                            stride_vd, o_d, M, i_b, i_h, HEAD_DIM, BLOCK_D, SUB_N, True, USE_TMA)

    b_vscale = tl.load(VScale + pid_bh * HEAD_DIM + o_d, mask=m_d, other=0.0)
    p_o = Out + i_b * stride_ob + i_h * stride_oh + o_m[:, None].to(tl.int64) * stride_on + o_d[None, :] * stride_od
    _store_rows(p_o, Lse + pid_bh.to(tl.int64) * N + o_m, b_acc * b_vscale[None, :], b_m, b_l, b_shift, m_tile,
                o_m < N)


def fp8_forward(x: Fp8Inputs, kv_count: torch.Tensor, kv_index: torch.Tensor, block_q: int, block_k: int,
                scale: float, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The FP8 forward over quantized inputs ``x`` (from :func:`quantize`, or any :class:`Fp8Inputs` whose
    v8 has unit token stride). Returns out (``like``'s dtype and layout, [B, H, N, D]) and lse float32
    [B, H, N] (natural log)."""
    if x.v8.stride(2) != 1 or x.q8.stride(-1) != 1 or x.k8.stride(-1) != 1 or x.q8_lo.stride() != x.q8.stride():
        raise ValueError("fp8_forward needs q8 (and q8_lo, with q8's strides), k8 with unit head-dim stride and v8 "
                         "with unit token stride (as made by quantize)")
    b, h, n, d = x.q8.shape
    m = x.k8.shape[2]
    out = bf16._alloc(like)
    lse = bf16._alloc(like, (b, h, n), torch.float32)
    vt = x.v8.transpose(-1, -2)  # [B, H, D, M], tokens contiguous
    use_tma = bf16._use_tma("fwd", x.k8, vt)
    k_src, v_src = ((TensorDescriptor.from_tensor(x.k8, [1, 1, 16, d]), TensorDescriptor.from_tensor(vt, [1, 1, d, 16]))
                    if use_tma else (x.k8, vt))
    launch_tuned(
        _bsa_fp8_fwd_kernel, lambda meta: (triton.cdiv(n, meta["ROWS"]), b * h), (n, m, like.dtype, like.device),
        x.q8, x.q8_lo, k_src, v_src, x.q_scale, x.k_scale, x.v_scale, x.k_mean, out, lse, kv_count, kv_index,
        *x.q8.stride()[:3], *x.k8.stride()[:3], *vt.stride()[:3], *out.stride(),
        *bf16._table_strides(kv_count, kv_index, b, h),
        h, n, m, x.q_scale.shape[2], x.k_scale.shape[2], scale * LOG2E,
        HEAD_DIM=d, BLOCK_D=bf16.padded_pow2(d), BLOCK_M=block_q, BLOCK_N=block_k, USE_TMA=use_tma,
    )
    return out, lse


def triton_fp8_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_count: torch.Tensor,
                         kv_index: torch.Tensor, block_q: int, block_k: int,
                         scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize` then :func:`fp8_forward`. q: [B, H, N, D], k, v: [B, H, M, D]; returns out [B, H, N, D]
    (q's dtype) and lse float32 [B, H, N]."""
    return fp8_forward(quantize(q, k, v, block_q, block_k), kv_count, kv_index, block_q, block_k, scale, q)
