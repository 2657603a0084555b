"""What bounds the int8 block-sparse forward (``triton_int8_attention.int8_forward``): its loop taken apart.

At the Wan 1.3B shape (Q, K, V [1, 12, 32,760, 128] bf16, one 128x64 top-k mask at 95% from ``predict_mask``)
the library's forward (autotuned) and a copy of its single-tile kernel (the library's until c13c13d: one kept tile
per step, V scaled per key block) with switches, each timed alone (``triton.testing.do_bench``) at fixed configs
(query rows per program, warps, pipeline stages):

* Q: read quantized (the library) or quantized in the kernel's prologue from bf16 Q (the design before: Triton then
  kept the int8 tile in shared memory and re-read it byte by byte in every iteration);
* the int32 logits to floats: a conversion instruction (the library), or the bits of R + logit (R = 1.5 * 2^23,
  R's subtraction folded into the exponential's FMA) by two logical operations or by an integer addition in
  inline PTX (written as a Triton addition it becomes the product's initial accumulator, whose set-up between the
  MMAs makes ptxas serialise every wgmma of the kernel);
* the P V product: promoted by Triton (``max_num_imprecise_acc``, the single-tile library's; it reads the MMA's
  registers early, so ptxas serialises every wgmma), from zero and added to the accumulator by the rescale's FMA
  (not serialised, but [ROWS, D] more registers), or accumulated in the MMA across all tiles (no promotion:
  Hopper's fp8 MMA accumulates in reduced precision).

And the library's two-tile step rewritten with a switch (``--variants pairs``): the loop takes two kept tiles per
iteration (two Q K^T products, one joint row max, one rescale; V scaled per head, so the tiles of an iteration
share its unit), and the MMA accumulates P V over every step (no promotion: Hopper's fp8 MMA accumulates in reduced
precision, which shows over the full mask's long rows) or over FOLD steps, after which an FMA adds the product
into an fp32 accumulator and the MMA starts again from zero (the library folds every step; the fold is done by
the next step, after its logits, so that the MMA is not waited for at once). Each row also reports how far its
output is from the library's. The same step with V as two e4m3 terms (its rounded value and the rounded residual, a
second fp8 P V product per tile: the rounding that keeps the Gaussian inputs over issue 37's 0.03 bar,
``scripts/pv_rounding.py``) times what that product costs. The single-tile variants and the Gluon forward keep the
design they were written for, V scaled per key block: they run on the library's quantized inputs with V's head scale
repeated per block (the same values).

Beside them, the same forward written in Gluon with every MMA waited for explicitly
(``benchmarks/gluon_int8_forward.py``: nothing serialised, the accumulator's update beside Q K^T; 64 rows, 4
warps, 2 or 3 K/V tiles in flight).

Every variant's output is compared with the bf16 sparse kernel's (relative L1), at 95% and, for the promotions,
with the full mask, where the reduced-precision accumulation has the most tiles to grow over. Writes
``results/int8_kernel_limits/<gpu>.{json,md}``.

    python -m benchmarks int8_kernel_limits                       # CUDA only; every variant
    python -m benchmarks int8_kernel_limits --variants current    # the conversion instruction's rows and Gluon's
    python -m benchmarks int8_kernel_limits --variants pairs      # the two-tile step: P V over 0/1/4/8 steps, V's terms
"""
from __future__ import annotations

import argparse
import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

import sparsevid as sv
from sparsevid.ops import triton_attention as bf16
from sparsevid.ops import triton_int8_attention as int8
from sparsevid.ops import triton_fp8_attention as fp8
from . import gluon_int8_forward as gluon
from .report import write_result
from .run_info import run_metadata

BITS, CONVERT, ASM_ADD = 0, 1, 2  # the logits to floats
FMA, TRITON_PROMOTION, NO_PROMOTION = 0, 1, 2  # P V into the accumulator
CONVERSIONS = {BITS: "bits (LOP3)", CONVERT: "cvt (I2FP)", ASM_ADD: "bits (IADD, PTX)"}
PROMOTIONS = {FMA: "fresh product + FMA", TRITON_PROMOTION: "max_num_imprecise_acc", NO_PROMOTION: "none"}
GLUON = "fresh product + FMA, explicit waits (Gluon)"
_PTX = tl.constexpr(not bf16.INTERPRET)
_ROUND = tl.constexpr(12582912.0)  # R = 1.5 * 2^23
_ROUND_BITS = tl.constexpr(0x4B400000)  # its bits: these + x are the float R + x for int32 |x| < 2^22
_LOW23 = tl.constexpr(0x7FFFFF)


@triton.jit
def _logits(b_s, CONV: tl.constexpr):
    """int32 logits b_s as floats: R + logit (R = 1.5 * 2^23) for BITS and ASM_ADD, the logit for CONVERT."""
    if CONV == 0:
        return ((b_s & _LOW23) ^ _ROUND_BITS).to(tl.float32, bitcast=True)
    elif CONV == 1:
        return b_s.to(tl.float32)
    elif _PTX:
        return tl.inline_asm_elementwise("add.s32 $0, $1, 0x4B400000;", "=r,r", [b_s], dtype=tl.int32,
                                         is_pure=True, pack=1).to(tl.float32, bitcast=True)
    else:
        return (b_s + _ROUND_BITS).to(tl.float32, bitcast=True)


@triton.jit
def _variant_tile(b_acc, b_m, b_l, v_unit, b_q8, b_rs, v_scale, k_src, v_src, start_n, stride_kn, stride_vd, o_d, M,
                  i_b, i_h, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SUB_N: tl.constexpr,
                  MASK_COLS: tl.constexpr, CONV: tl.constexpr, PROMO: tl.constexpr):
    """The library's ``_int8_tile`` (tensor descriptors only) with the switches CONV and PROMO."""
    b_kt = bf16._load_rows(k_src, start_n, 0, o_d, M, HEAD_DIM, BLOCK_D, SUB_N, MASK_COLS, True, True, i_b, i_h)
    b_v = fp8._load_v(v_src, start_n, stride_vd, o_d, M, HEAD_DIM, BLOCK_D, SUB_N, MASK_COLS, True, i_b, i_h)
    b_f = _logits(tl.dot(b_q8, b_kt, out_dtype=tl.int32), CONV)
    if MASK_COLS:
        m_cols = (start_n + tl.arange(0, SUB_N) < M)[None, :]
        b_f = tl.where(m_cols, b_f, -float("inf"))
    if CONV == 1:
        b_m_new = tl.maximum(b_m, tl.max(b_f, 1) * b_rs - fp8._LOG2_P_SCALE)
        b_p = tl.math.exp2(tl.fma(b_f, b_rs[:, None], -b_m_new[:, None]))
    else:
        b_rs = (b_rs.to(tl.int32, bitcast=True) & -4).to(tl.float32, bitcast=True)
        b_c = tl.maximum(b_m, (tl.max(b_f, 1) - _ROUND) * b_rs - fp8._LOG2_P_SCALE) + _ROUND * b_rs
        b_m_new = b_c - _ROUND * b_rs
        b_p = tl.math.exp2(tl.fma(b_f, b_rs[:, None], -b_c[:, None]))
    if MASK_COLS:
        b_p = tl.where(m_cols, b_p, 0.0)
    b_alpha = tl.math.exp2(b_m - b_m_new)
    b_l = b_l * b_alpha + tl.sum(b_p, 1)
    b_rescale = (b_alpha * (v_unit / v_scale))[:, None]
    if PROMO == 0:
        b_acc = tl.fma(b_acc, b_rescale, tl.dot(b_p.to(tl.float8e4nv), b_v))
    elif PROMO == 1:
        b_acc = tl.dot(b_p.to(tl.float8e4nv), b_v, b_acc * b_rescale, max_num_imprecise_acc=SUB_N)
    else:
        b_acc = tl.dot(b_p.to(tl.float8e4nv), b_v, b_acc * b_rescale)
    return b_acc, b_m_new, b_l, v_scale


@triton.jit
def _quantized_rows(Q8, QScale, QShift, stride_q8b, stride_q8h, stride_q8n, i_b, i_h, o_m, o_d, m_tile, p_rows,
                    m_rows):
    """A program's rows of the quantized Q (``int8.quantize``): int8 [ROWS, D], their scales and smoothing shifts
    (float32 [ROWS])."""
    p_q = Q8 + i_b * stride_q8b + i_h * stride_q8h + o_m[:, None].to(tl.int64) * stride_q8n + o_d[None, :]
    return (tl.load(p_q, mask=m_tile, other=0), tl.load(QScale + p_rows, mask=m_rows, other=1.0),
            tl.load(QShift + p_rows, mask=m_rows, other=0.0))


@triton.jit
def _row_schedule(KScale, KvCount, KvIndex, pid_bh, i_b, i_h, q_block, stride_cb, stride_ch, stride_ib, stride_ih,
                  stride_ir, NUM_KV_BLOCKS, M, BLOCK_N: tl.constexpr, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """A program's kept-tile schedule (``bf16._tile_schedule``), its head's K block scales and the online softmax's
    starting state: (p_kscale, p_index, num_full, ragged_tail, last_block, b_m, b_l, b_acc)."""
    _, p_index, num_full, ragged_tail, last_block = bf16._tile_schedule(
        KvCount, KvIndex, i_b, i_h, q_block, stride_cb, stride_ch, stride_ib, stride_ih, stride_ir, NUM_KV_BLOCKS, M,
        BLOCK_N)
    return (KScale + pid_bh.to(tl.int64) * NUM_KV_BLOCKS, p_index, num_full, ragged_tail, last_block,
            tl.full([ROWS], float("-inf"), dtype=tl.float32), tl.zeros([ROWS], dtype=tl.float32),
            tl.zeros([ROWS, HEAD_DIM], dtype=tl.float32))


@triton.jit
def _variant_kernel(Q, Q8, QScale, QShift, KMean, K, V, KScale, VScale, Out, Lse, KvCount, KvIndex,
                    stride_qb, stride_qh, stride_qn, stride_q8b, stride_q8h, stride_q8n, stride_vd,
                    stride_ob, stride_oh, stride_on, stride_cb, stride_ch, stride_ib, stride_ih, stride_ir,
                    H, N, M, NUM_KV_BLOCKS, scale_log2, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, ROWS: tl.constexpr, Q_PROLOGUE: tl.constexpr, CONV: tl.constexpr,
                    PROMO: tl.constexpr):
    """The library's ``_bsa_int8_fwd_kernel`` (64-key tiles, head dim a power of two, K and V by descriptor) with
    the switches; Q_PROLOGUE quantizes bf16 Q [B, H, N, D] here (its row scale and shift too), else reads Q8."""
    _, pid_bh, i_b, i_h, q_block, o_m, o_d, m_tile = bf16._program_rows(H, N, HEAD_DIM, HEAD_DIM, BLOCK_M, ROWS)
    m_rows = o_m < N
    p_rows = pid_bh.to(tl.int64) * N + o_m
    if Q_PROLOGUE:
        p_q = Q + i_b * stride_qb + i_h * stride_qh + o_m[:, None].to(tl.int64) * stride_qn + o_d[None, :]
        b_q = tl.load(p_q, mask=m_tile, other=0.0).to(tl.float32)
        q_amax = tl.max(int8._abs_or_zero(b_q), 1)
        q_scale = int8._int8_scale(q_amax, int8._all_finite(b_q, 1))
        b_q8 = int8._round_int8(b_q * tl.math.div_rn(tl.zeros_like(q_amax) + int8._INT8_MAX, q_amax)[:, None])
        b_shift = tl.sum(b_q * tl.load(KMean + pid_bh * HEAD_DIM + o_d)[None, :], 1) * scale_log2
    else:
        b_q8, q_scale, b_shift = _quantized_rows(Q8, QScale, QShift, stride_q8b, stride_q8h, stride_q8n, i_b, i_h,
                                                 o_m, o_d, m_tile, p_rows, m_rows)
        b_shift = b_shift * scale_log2
    q_scale = tl.where((tl.max(tl.abs(b_q8), 1) == 0) & (q_scale == q_scale), 0.0, q_scale)
    b_rs = q_scale * scale_log2
    p_vscale = VScale + pid_bh.to(tl.int64) * NUM_KV_BLOCKS
    p_kscale, p_index, num_full, ragged_tail, last_block, b_m, b_l, b_acc = _row_schedule(
        KScale, KvCount, KvIndex, pid_bh, i_b, i_h, q_block, stride_cb, stride_ch, stride_ib, stride_ih, stride_ir,
        NUM_KV_BLOCKS, M, BLOCK_N, ROWS, HEAD_DIM)
    v_unit = tl.full([], 1.0, dtype=tl.float32)
    for it in range(0, num_full):
        kv_block = tl.load(p_index + it)
        b_acc, b_m, b_l, v_unit = _variant_tile(
            b_acc, b_m, b_l, v_unit, b_q8, b_rs * tl.load(p_kscale + kv_block), tl.load(p_vscale + kv_block), K, V,
            kv_block * BLOCK_N, 0, stride_vd, o_d, M, i_b, i_h, HEAD_DIM, HEAD_DIM, BLOCK_N, False, CONV, PROMO)
    if ragged_tail:
        b_acc, b_m, b_l, v_unit = _variant_tile(
            b_acc, b_m, b_l, v_unit, b_q8, b_rs * tl.load(p_kscale + last_block), tl.load(p_vscale + last_block), K,
            V, last_block * BLOCK_N, 0, stride_vd, o_d, M, i_b, i_h, HEAD_DIM, HEAD_DIM, BLOCK_N, True, CONV, PROMO)
    p_o = Out + i_b * stride_ob + i_h * stride_oh + o_m[:, None].to(tl.int64) * stride_on + o_d[None, :]
    bf16._store_rows(p_o, Lse + p_rows, b_acc * v_unit, b_m, b_l, b_shift, m_tile, m_rows)


@triton.jit
def _tile_logits(b_q8, b_rs, k_src, start_n, o_d, M, i_b, i_h, HEAD_DIM: tl.constexpr, SUB_N: tl.constexpr,
                 MASK_COLS: tl.constexpr):
    """Base-2 logits as float32 [ROWS, SUB_N] before the row max is taken off: int8 Q K^T of keys
    [start_n, start_n + SUB_N) (columns past M at -inf where MASK_COLS), scaled by b_rs in the exponential's FMA."""
    b_kt = bf16._load_rows(k_src, start_n, 0, o_d, M, HEAD_DIM, HEAD_DIM, SUB_N, MASK_COLS, True, True, i_b, i_h)
    b_f = tl.dot(b_q8, b_kt, out_dtype=tl.int32).to(tl.float32)
    if MASK_COLS:
        b_f = tl.where((start_n + tl.arange(0, SUB_N) < M)[None, :], b_f, -float("inf"))
    return b_f


@triton.jit
def _fold(b_acc, b_pv, b_f, b_alpha, step, FOLD: tl.constexpr):
    """The accumulators before step ``step``'s P V products, the output so far being b_acc * b_f + b_pv (b_pv
    float32 [ROWS, D] accumulated by the MMA, b_f float32 [ROWS]): with FOLD > 0 every FOLD-th step first adds b_pv
    into b_acc by an FMA (after the step's logits: the last MMA had them to finish) and restarts it from zero, so
    that the MMA's reduced-precision accumulation spans at most FOLD steps; FOLD = 0 never does (b_acc stays zero).
    Returns b_acc, b_pv rescaled by the step's b_alpha (the MMA accumulates into it) and b_f."""
    if FOLD > 0:
        if step % FOLD == 0:
            b_acc = tl.fma(b_acc, b_f[:, None], b_pv)
            b_pv = tl.zeros_like(b_pv)
            b_f = tl.zeros_like(b_f) + 1.0
    return b_acc, b_pv * b_alpha[:, None], b_f * b_alpha


@triton.jit
def _pv(b_pv, b_p8, v_src, vlo_src, start_n, stride_vd, o_d, M, i_b, i_h, HEAD_DIM: tl.constexpr,
        SUB_N: tl.constexpr, MASK_COLS: tl.constexpr, V_LO: tl.constexpr):
    """b_pv + P V for the keys from start_n, P in e4m3 (b_p8 [ROWS, SUB_N]); with V_LO V is two e4m3 terms, its
    rounded value and the rounded residual (vlo_src, same units and layout), one more product."""
    b_v = fp8._load_v(v_src, start_n, stride_vd, o_d, M, HEAD_DIM, HEAD_DIM, SUB_N, MASK_COLS, True, i_b, i_h)
    b_pv = tl.dot(b_p8, b_v, b_pv)
    if V_LO:
        b_vlo = fp8._load_v(vlo_src, start_n, stride_vd, o_d, M, HEAD_DIM, HEAD_DIM, SUB_N, MASK_COLS, True, i_b, i_h)
        b_pv = tl.dot(b_p8, b_vlo, b_pv)
    return b_pv


@triton.jit
def _pair_tile(b_acc, b_pv, b_f, b_m, b_l, b_q8, rs_a, rs_b, k_src, v_src, vlo_src, start_a, start_b, stride_vd,
               o_d, M, i_b, i_h, step, HEAD_DIM: tl.constexpr, SUB_N: tl.constexpr, FOLD: tl.constexpr,
               V_LO: tl.constexpr):
    """Two full kept tiles (keys from start_a and start_b) in one step: one row max, one rescale."""
    b_fa = _tile_logits(b_q8, rs_a, k_src, start_a, o_d, M, i_b, i_h, HEAD_DIM, SUB_N, False)
    b_fb = _tile_logits(b_q8, rs_b, k_src, start_b, o_d, M, i_b, i_h, HEAD_DIM, SUB_N, False)
    b_m_new = tl.maximum(b_m, tl.maximum(tl.max(b_fa, 1) * rs_a, tl.max(b_fb, 1) * rs_b) - fp8._LOG2_P_SCALE)
    b_pa = tl.math.exp2(tl.fma(b_fa, rs_a[:, None], -b_m_new[:, None]))
    b_pb = tl.math.exp2(tl.fma(b_fb, rs_b[:, None], -b_m_new[:, None]))
    b_alpha = tl.math.exp2(b_m - b_m_new)
    b_l = b_l * b_alpha + tl.sum(b_pa, 1) + tl.sum(b_pb, 1)
    b_acc, b_pv, b_f = _fold(b_acc, b_pv, b_f, b_alpha, step, FOLD)
    b_pv = _pv(b_pv, b_pa.to(tl.float8e4nv), v_src, vlo_src, start_a, stride_vd, o_d, M, i_b, i_h, HEAD_DIM, SUB_N,
               False, V_LO)
    b_pv = _pv(b_pv, b_pb.to(tl.float8e4nv), v_src, vlo_src, start_b, stride_vd, o_d, M, i_b, i_h, HEAD_DIM, SUB_N,
               False, V_LO)
    return b_acc, b_pv, b_f, b_m_new, b_l


@triton.jit
def _single_tile(b_acc, b_pv, b_f, b_m, b_l, b_q8, b_rs, k_src, v_src, vlo_src, start_n, stride_vd, o_d, M, i_b, i_h,
                 step, HEAD_DIM: tl.constexpr, SUB_N: tl.constexpr, MASK_COLS: tl.constexpr, FOLD: tl.constexpr,
                 V_LO: tl.constexpr):
    """One kept tile (the odd one out, or the sequence's short last block)."""
    b_f_tile = _tile_logits(b_q8, b_rs, k_src, start_n, o_d, M, i_b, i_h, HEAD_DIM, SUB_N, MASK_COLS)
    b_m_new = tl.maximum(b_m, tl.max(b_f_tile, 1) * b_rs - fp8._LOG2_P_SCALE)
    b_p = tl.math.exp2(tl.fma(b_f_tile, b_rs[:, None], -b_m_new[:, None]))
    if MASK_COLS:
        b_p = tl.where((start_n + tl.arange(0, SUB_N) < M)[None, :], b_p, 0.0)
    b_alpha = tl.math.exp2(b_m - b_m_new)
    b_l = b_l * b_alpha + tl.sum(b_p, 1)
    b_acc, b_pv, b_f = _fold(b_acc, b_pv, b_f, b_alpha, step, FOLD)
    b_pv = _pv(b_pv, b_p.to(tl.float8e4nv), v_src, vlo_src, start_n, stride_vd, o_d, M, i_b, i_h, HEAD_DIM, SUB_N,
               MASK_COLS, V_LO)
    return b_acc, b_pv, b_f, b_m_new, b_l


@triton.jit
def _pairs_kernel(Q8, QScale, QShift, K, V, VLo, KScale, VHeadScale, Out, Lse, KvCount, KvIndex,
                  stride_q8b, stride_q8h, stride_q8n, stride_vd, stride_ob, stride_oh, stride_on,
                  stride_cb, stride_ch, stride_ib, stride_ih, stride_ir, H, N, M, NUM_KV_BLOCKS, scale_log2,
                  HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
                  FOLD: tl.constexpr, V_LO: tl.constexpr):
    """The int8 forward over pairs of kept tiles (P V accumulated by the MMA over FOLD steps, 0: over all);
    V [B, H, D, M'] e4m3 in units of VHeadScale [B * H]; with V_LO also V's rounding residual VLo (same units and
    layout), a second P V product per tile."""
    _, pid_bh, i_b, i_h, q_block, o_m, o_d, m_tile = bf16._program_rows(H, N, HEAD_DIM, HEAD_DIM, BLOCK_M, ROWS)
    m_rows = o_m < N
    p_rows = pid_bh.to(tl.int64) * N + o_m
    b_q8, q_scale, b_shift = _quantized_rows(Q8, QScale, QShift, stride_q8b, stride_q8h, stride_q8n, i_b, i_h, o_m,
                                             o_d, m_tile, p_rows, m_rows)
    b_rs = q_scale * scale_log2
    b_shift = b_shift * scale_log2
    p_kscale, p_index, num_full, ragged_tail, last_block, b_m, b_l, b_acc = _row_schedule(
        KScale, KvCount, KvIndex, pid_bh, i_b, i_h, q_block, stride_cb, stride_ch, stride_ib, stride_ih, stride_ir,
        NUM_KV_BLOCKS, M, BLOCK_N, ROWS, HEAD_DIM)
    b_pv = tl.zeros([ROWS, HEAD_DIM], dtype=tl.float32)
    b_f = tl.full([ROWS], 1.0, dtype=tl.float32)
    for it in range(0, num_full // 2):
        blk_a = tl.load(p_index + 2 * it)
        blk_b = tl.load(p_index + 2 * it + 1)
        b_acc, b_pv, b_f, b_m, b_l = _pair_tile(b_acc, b_pv, b_f, b_m, b_l, b_q8, b_rs * tl.load(p_kscale + blk_a),
                                                b_rs * tl.load(p_kscale + blk_b), K, V, VLo, blk_a * BLOCK_N,
                                                blk_b * BLOCK_N, stride_vd, o_d, M, i_b, i_h, it, HEAD_DIM, BLOCK_N,
                                                FOLD, V_LO)
    step = num_full // 2
    if num_full % 2 == 1:
        blk = tl.load(p_index + num_full - 1)
        b_acc, b_pv, b_f, b_m, b_l = _single_tile(b_acc, b_pv, b_f, b_m, b_l, b_q8, b_rs * tl.load(p_kscale + blk),
                                                  K, V, VLo, blk * BLOCK_N, stride_vd, o_d, M, i_b, i_h, step,
                                                  HEAD_DIM, BLOCK_N, False, FOLD, V_LO)
        step += 1
    if ragged_tail:
        b_acc, b_pv, b_f, b_m, b_l = _single_tile(b_acc, b_pv, b_f, b_m, b_l, b_q8,
                                                  b_rs * tl.load(p_kscale + last_block), K, V, VLo,
                                                  last_block * BLOCK_N, stride_vd, o_d, M, i_b, i_h, step, HEAD_DIM,
                                                  BLOCK_N, True, FOLD, V_LO)
    if FOLD > 0:
        b_pv = tl.fma(b_acc, b_f[:, None], b_pv)
    p_o = Out + i_b * stride_ob + i_h * stride_oh + o_m[:, None].to(tl.int64) * stride_on + o_d[None, :]
    bf16._store_rows(p_o, Lse + p_rows, b_pv * tl.load(VHeadScale + pid_bh), b_m, b_l, b_shift, m_tile, m_rows)


def per_block_v_scale(x: int8.Int8Inputs) -> int8.Int8Inputs:
    """``x`` with V's head scale repeated for every key block (float32 [B, H, NUM_KV_BLOCKS]): the inputs of the
    single-tile variants and the Gluon forward, written for V scaled per key block."""
    return x._replace(v_scale=x.v_scale[..., None].expand(-1, -1, x.k_scale.shape[2]).contiguous())


def v_residual(v: torch.Tensor, x: int8.Int8Inputs) -> torch.Tensor:
    """V's rounding residual v / v_scale - v8 in e4m3, a second term of V (v ~ (v8 + residual) * v_scale, the
    residual at most half of v8's step, within e4m3's range at the same scale), laid out as x.v8's buffer: a
    [B, H, D, M] view of [B, H, D, M'] with tokens contiguous."""
    vt = x.v8.transpose(-1, -2)
    residual = v.float() / x.v_scale[..., None, None] - x.v8.float()
    buffer = torch.zeros(*vt.shape[:3], vt.stride(2), dtype=x.v8.dtype, device=v.device)
    buffer[..., :vt.shape[3]] = residual.transpose(-1, -2).clamp(-fp8.FP8_MAX, fp8.FP8_MAX).to(x.v8.dtype)
    return buffer[..., :vt.shape[3]]


def run_pairs(q, qx, x, mask, rows: int, warps: int, stages: int, fold: int = 0, v_lo: torch.Tensor | None = None):
    """A launcher of the pairs forward over q and its quantized inputs (qx, x from ``int8.quantize``: V scaled per
    head), P V accumulated by the MMA over ``fold`` steps (0: over all), with V as two e4m3 terms where ``v_lo``
    (:func:`v_residual`) is given; see run_variant: (launch, out, lse)."""
    b, h, n, d = q.shape
    m = x.k8.shape[2]
    out, lse = torch.empty_like(q), q.new_empty((b, h, n), dtype=torch.float32)
    vt, v_scale = x.v8.transpose(-1, -2), x.v_scale.reshape(-1).contiguous()
    k_src = TensorDescriptor.from_tensor(x.k8, [1, 1, mask.block_k, d])
    v_src = TensorDescriptor.from_tensor(vt, [1, 1, d, mask.block_k])
    vlo_src = v_src if v_lo is None else TensorDescriptor.from_tensor(v_lo, [1, 1, d, mask.block_k])
    grid = (triton.cdiv(n, rows), b * h)

    def launch():
        _pairs_kernel[grid](
            qx.q8, qx.q_scale, qx.q_shift, k_src, v_src, vlo_src, x.k_scale, v_scale, out, lse, mask.kv_count,
            mask.kv_index, *qx.q8.stride()[:3], vt.stride(2), *out.stride()[:3],
            *bf16._table_strides(mask.kv_count, mask.kv_index, b, h), h, n, m, x.k_scale.shape[2],
            (d ** -0.5) * bf16.LOG2E, HEAD_DIM=d, BLOCK_M=mask.block_q, BLOCK_N=mask.block_k, ROWS=rows,
            FOLD=fold, V_LO=v_lo is not None, num_warps=warps, num_stages=stages)
    return launch, out, lse


def run_variant(q, qx, x, mask, rows: int, warps: int, stages: int, q_prologue: bool = False, conv: int = CONVERT,
                promo: int = TRITON_PROMOTION, maxnreg: int | None = None):
    """A launcher of one variant over q [B, H, N, D] (contiguous head dim), its quantized inputs (qx, x from
    ``int8.quantize``) and a 64-key mask: (launch, out, lse), out and lse written by each launch. ``maxnreg`` caps
    the registers per thread (more programs per SM)."""
    b, h, n, d = q.shape
    m = x.k8.shape[2]
    out, lse = torch.empty_like(q), q.new_empty((b, h, n), dtype=torch.float32)
    vt = x.v8.transpose(-1, -2)
    k_src = TensorDescriptor.from_tensor(x.k8, [1, 1, mask.block_k, d])
    v_src = TensorDescriptor.from_tensor(vt, [1, 1, d, mask.block_k])
    grid = (triton.cdiv(n, rows), b * h)

    def launch():
        _variant_kernel[grid](
            q, qx.q8, qx.q_scale, qx.q_shift, x.k_mean, k_src, v_src, x.k_scale, x.v_scale, out, lse, mask.kv_count,
            mask.kv_index, *q.stride()[:3], *qx.q8.stride()[:3], vt.stride(2), *out.stride()[:3],
            *bf16._table_strides(mask.kv_count, mask.kv_index, b, h), h, n, m, x.k_scale.shape[2],
            (d ** -0.5) * bf16.LOG2E, HEAD_DIM=d, BLOCK_M=mask.block_q, BLOCK_N=mask.block_k, ROWS=rows,
            Q_PROLOGUE=q_prologue, CONV=conv, PROMO=promo, num_warps=warps, num_stages=stages,
            **({"maxnreg": maxnreg} if maxnreg else {}))
    return launch, out, lse


def rel_l1(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).abs().sum() / ref.double().abs().sum())


CONFIGS = ((128, 4, 3), (128, 4, 2), (128, 8, 2), (128, 8, 3), (64, 4, 3), (64, 4, 2), (64, 4, 4))
_SHORT = CONFIGS[:3] + CONFIGS[4:5]
# Register caps for more programs per SM (`scripts/sass_loop.py int8 --rows R --warps W --maxnreg C`, Triton 3.6):
# 64 rows, 4 warps at 168 registers: three programs instead of two (213 uncapped; 12 bytes of spill stores capped);
# 128 rows, 8 warps at 128: two instead of one (202 uncapped; 668 bytes spilled capped)
CAPPED = ((64, 4, 3, 168), (64, 4, 2, 168), (128, 8, 2, 128))
VARIANTS = (  # (q_prologue, conv, promo, configs)
    (False, BITS, FMA, CONFIGS),
    *((False, conv, FMA, _SHORT) for conv in (CONVERT, ASM_ADD)),
    (True, BITS, FMA, CONFIGS[:1] + CONFIGS[4:5]),
    *((False, BITS, promo, _SHORT) for promo in (TRITON_PROMOTION, NO_PROMOTION)),
    (False, CONVERT, TRITON_PROMOTION, _SHORT),
)
FULL_MASK_VARIANTS = ((BITS, FMA, CONFIGS[4]), (BITS, TRITON_PROMOTION, CONFIGS[0]),
                      (BITS, NO_PROMOTION, CONFIGS[0]))
# the library's conversion (every promotion) only
CURRENT_VARIANTS = (*((False, CONVERT, promo, _SHORT) for promo in (FMA, TRITON_PROMOTION, NO_PROMOTION)),
                    *((False, CONVERT, promo, CAPPED) for promo in (TRITON_PROMOTION, NO_PROMOTION)))
CURRENT_FULL_MASK_VARIANTS = ((CONVERT, FMA, CONFIGS[4]), (CONVERT, TRITON_PROMOTION, CONFIGS[0]),
                              (CONVERT, NO_PROMOTION, CONFIGS[0]))
GLUON_STAGES = (2, 3)


# The two-tile step's configs (rows, warps, stages) and the steps over which its MMA accumulates P V (0: all; the
# library's forward is 1, with the fold deferred to the next step as here)
PAIR_CONFIGS = ((64, 4, 3), (64, 4, 2))
PAIR_FULL_CONFIGS = ((64, 4, 3),)
PAIR_FOLDS = (0, 1, 4, 8)
TWO_TERM_FOLDS = (0, 1)


def pairs_label(fold: int, two_term_v: bool = False) -> str:
    """The promotion column of a two-tile row: over how many steps the MMA accumulates P V, and V's terms."""
    return (f"pairs of tiles, V per head{' (two e4m3 terms)' if two_term_v else ''}, "
            + ("none" if fold == 0 else f"fresh product every {fold} step(s) + FMA"))


def measure(q, k, v, mask, full, bench, variants: str = "all") -> dict:
    """Every timing and error of ``variants`` ("all", "current" or "pairs"; see the module's docstring);
    ``bench`` times a callable in ms."""
    native, native_full = (sv.block_sparse_attention(q, k, v, m, backend="triton") for m in (mask, full))
    qx, x = int8.quantize(q, k, v, mask.block_k)
    blocks = per_block_v_scale(x)
    library = lambda m=mask: int8.int8_forward(qx, x, m.kv_count, m.kv_index, m.block_q, m.block_k,  # noqa: E731
                                               q.shape[-1] ** -0.5, q)
    result = {"bf16_ms": bench(lambda: sv.block_sparse_attention(q, k, v, mask, backend="triton")),
              "quantize_ms": bench(lambda: int8.quantize(q, k, v, mask.block_k)),
              "library_ms": bench(library), "library_rel_l1": rel_l1(library()[0], native),
              "library_full_ms": bench(lambda: library(full)), "library_full_rel_l1": rel_l1(library(full)[0],
                                                                                           native_full), "rows": []}
    print({key: value for key, value in result.items() if key != "rows"}, flush=True)
    def timed(launcher, ref, **label):
        launch, out, _ = launcher
        launch()
        row = {**label, "ms": bench(launch), "rel_l1": rel_l1(out, ref)}
        print(row, flush=True)
        return row

    def timed_row(m, ref, rows, warps, stages, q_prologue, conv, promo, maxnreg=None, **label):
        return timed(run_variant(q, qx, blocks, m, rows, warps, stages, q_prologue, conv, promo, maxnreg), ref,
                     q="prologue" if q_prologue else "read", conv=CONVERSIONS[conv], promo=PROMOTIONS[promo],
                     rows=rows, warps=warps, stages=stages, maxnreg=maxnreg, **label)

    if variants == "pairs":
        v_lo = v_residual(v, x)

        def pairs_row(m, ref, rows, warps, stages, fold, two_term_v=False, **label):
            launcher = run_pairs(q, qx, x, m, rows, warps, stages, fold, v_lo if two_term_v else None)
            row = timed(launcher, ref, q="read", conv=CONVERSIONS[CONVERT], promo=pairs_label(fold, two_term_v),
                        rows=rows, warps=warps, stages=stages, **label)
            # how far the MMA's accumulation moves the output from the library's (a fresh product every step)
            row["rel_l1_vs_library"] = rel_l1(launcher[1], library(m)[0])
            return row
        result["rows"] += [pairs_row(mask, native, *config, fold) for fold in PAIR_FOLDS for config in PAIR_CONFIGS]
        result["rows"] += [pairs_row(full, native_full, *config, fold, mask="full") for fold in PAIR_FOLDS
                           for config in PAIR_FULL_CONFIGS]
        # V as two e4m3 terms (issue 37's Gaussian accuracy bar; scripts/pv_rounding.py): what its second product
        # per tile costs, accumulating in the MMA and with the library's fold
        result["rows"] += [pairs_row(mask, native, *config, fold, two_term_v=True) for fold in TWO_TERM_FOLDS
                           for config in PAIR_CONFIGS]
        result["rows"] += [pairs_row(full, native_full, *PAIR_FULL_CONFIGS[0], fold, two_term_v=True, mask="full")
                           for fold in TWO_TERM_FOLDS]
        return result
    single, full_variants = ((CURRENT_VARIANTS, CURRENT_FULL_MASK_VARIANTS) if variants == "current"
                             else (VARIANTS, FULL_MASK_VARIANTS))
    result["rows"] += [timed_row(mask, native, *config[:3], q_prologue, conv, promo, *config[3:])
                       for q_prologue, conv, promo, configs in single for config in configs]
    result["rows"] += [timed_row(full, native_full, *config[:3], False, conv, promo, *config[3:], mask="full")
                       for conv, promo, config in full_variants]
    if gluon.supported(qx, blocks, mask.block_q, mask.block_k):
        def gluon_row(m, ref, stages, **label):
            launch = lambda: gluon.gluon_int8_forward(qx, blocks, m.kv_count, m.kv_index, m.block_q,  # noqa: E731
                                                      m.block_k, q.shape[-1] ** -0.5, q, stages)
            out = launch()[0]
            row = {"q": "read", "conv": CONVERSIONS[CONVERT], "promo": GLUON, "rows": gluon.ROWS,
                   "warps": gluon.WARPS, "stages": stages, **label, "ms": bench(launch), "rel_l1": rel_l1(out, ref),
                   "rel_l1_vs_library": rel_l1(out, library()[0]) if m is mask else None}
            print(row, flush=True)
            return row
        result["rows"] += [gluon_row(mask, native, stages) for stages in GLUON_STAGES]
        result["rows"] += [gluon_row(full, native_full, GLUON_STAGES[-1], mask="full")]
    return result


def markdown(result: dict) -> str:
    lines = [f"bf16 sparse kernel {result['bf16_ms']:.3f} ms; int8: quantize (Q, K and V) {result['quantize_ms']:.3f} "
             f"ms, library forward (autotuned) {result['library_ms']:.3f} ms, rel L1 vs bf16 "
             f"{result['library_rel_l1']:.4f}; full mask {result['library_full_ms']:.3f} ms, rel L1 vs bf16 "
             f"{result['library_full_rel_l1']:.4f}", "",
             "| mask | Q | logits to floats | P V promotion | rows | warps | stages | register cap | ms | rel L1 vs bf16 "
             "| rel L1 vs library |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        vs_library = "" if r.get("rel_l1_vs_library") is None else f"{r['rel_l1_vs_library']:.4f}"
        lines.append(f"| {r.get('mask', '95%')} | {r['q']} | {r['conv']} | {r['promo']} | {r['rows']} | "
                     f"{r['warps']} | {r['stages']} | {r.get('maxnreg') or '-'} | {r['ms']:.3f} | {r['rel_l1']:.4f} "
                     f"| {vs_library} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--variants", choices=("all", "current", "pairs"), default="all",
                        help="all: every switch; current: the conversion instruction's rows (and Gluon's) only; "
                             "pairs: the library's two-tile step with P V accumulated by the MMA over all, 1, 4 or 8 "
                             "steps, and with V as two e4m3 terms")
    args = parser.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        print("int8_kernel_limits needs a Hopper or newer GPU (tensor descriptors, fp8)", file=sys.stderr)
        return 2
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, 12, 32760, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    mask = sv.predict_mask(q, k, rule="topk", topk=0.05, block_q=128, block_k=64)[0]
    full = sv.SparseMask.full(q.shape[2], k.shape[2], 128, 64, device="cuda")
    result = measure(q, k, v, mask, full, lambda fn: triton.testing.do_bench(fn, rep=100),
                     variants=args.variants)
    write_result(args.out, run_metadata(q.device), result, markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
