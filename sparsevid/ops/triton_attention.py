"""Triton kernels for block-sparse attention: forward (online softmax in base 2) and backward (dQ; dK, dV).

Each program owns rows of one tile row (forward, dQ: ROWS rows of a query block; dK/dV: COLS keys of a key
block) and visits only the kept tiles listed in the mask's index tables, so skipped tiles cost nothing.
How a block is split across programs and inner-loop sub-tiles is autotuned. Inputs may be any strided
[B, H, T, D] views; index tables may broadcast over batch and head (stride 0).

Set ``TRITON_INTERPRET=1`` before importing this module to run the kernels on the CPU (tests).
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .triton_launch import AUTOTUNE, INTERPRET, launch_tuned

LOG2E = 1.4426950408889634
LN2 = tl.constexpr(0.6931471805599453)

_TMA_KERNELS = ("fwd", "dq", "dkdv")


def tma_kernels(setting: str) -> frozenset[str]:
    """SPARSEVID_TMA: "all", "none" or a comma list of fwd, dq, dkdv."""
    if setting in ("all", "none"):
        return frozenset(_TMA_KERNELS if setting == "all" else ())
    chosen = frozenset(name.strip() for name in setting.split(",") if name.strip())
    if not chosen <= set(_TMA_KERNELS):
        raise ValueError(f"SPARSEVID_TMA must be 'all', 'none' or a comma list of {_TMA_KERNELS}, got {setting!r}")
    return chosen


# The kernels that read K/V (fwd, dq) or Q/dO (dkdv) through the tensor-memory accelerator where the GPU and
# the inputs allow it (Hopper or newer); the others use plain pointer loads.
TMA = tma_kernels(os.environ.get("SPARSEVID_TMA", "all"))


def _box_rows_hook(sources: tuple[str, str], rows):
    """Autotuning pre-hook: the box of the tensor descriptors passed as arguments ``sources`` becomes
    [1, 1, rows(args), D], the sub-tile the config's inner loop reads (pointer arguments are left alone)."""
    def hook(args: dict) -> None:
        for name in sources:
            if isinstance(args[name], TensorDescriptor):
                args[name].block_shape = [1, 1, rows(args), args[name].block_shape[-1]]
    return hook


def _configs(split: str, inner: str, choices: tuple[tuple[int, ...], ...], box_hook,
             interpreted: tuple[int, ...] = (64, 32, 4, 1)) -> list[triton.Config]:
    """Autotuning space, as (split, inner, warps, stages[, register cap]) choices: rows a program owns
    (``split``, a divisor of its mask block), the sub-tile of the inner loop (``inner``, a divisor of the
    visited blocks), warps, pipeline stages and an optional cap on registers per thread. A short list of
    shapes that do well on Hopper keeps the first call's compile time (every config is compiled) near a
    minute. When interpreted, one config (``interpreted``; by default one that exercises both splits); with
    autotuning off, one config valid for every block size. ``box_hook`` (:func:`_box_rows_hook`) fits the
    descriptors to each config."""
    if INTERPRET:
        choices = (interpreted,)
    elif not AUTOTUNE:
        choices = ((64, 64, 4, 3),)
    return [triton.Config({split: c[0], inner: c[1]}, num_warps=c[2], num_stages=c[3],
                          maxnreg=c[4] if len(c) > 4 else None, pre_hook=box_hook) for c in choices]


def _prune(split: str, own_block: str, inner: str, inner_block: str, whole_tiles_flag: str | None = None):
    """Drop configs whose splits are larger than the mask blocks they divide; when the kernel argument
    ``whole_tiles_flag`` is set (the kernel then ignores ``inner``), keep one inner size only."""
    def prune(configs, named_args, **kwargs):
        args = {**named_args, **kwargs}
        kept = [c for c in configs if c.kwargs[split] <= args[own_block] and c.kwargs[inner] <= args[inner_block]]
        if whole_tiles_flag is not None and args[whole_tiles_flag]:
            largest = max(c.kwargs[inner] for c in kept)
            kept = [c for c in kept if c.kwargs[inner] == largest]
        return kept
    return {"early_config_prune": prune}


_TUNE_KEY = ["HEAD_DIM", "BLOCK_M", "BLOCK_N", "N", "M", "USE_TMA"]


@triton.jit
def _program_rows(H, N, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, ROWS: tl.constexpr):
    """The ROWS rows of program (pid_m, b * H + h) over a sequence of N tokens in blocks of BLOCK_M (query rows
    of a forward or dQ grid, key rows of the dK/dV grid): (pid_m, pid_bh, i_b, i_h, the block holding them, their
    offsets o_m [ROWS], the channel offsets o_d [BLOCK_D], the in-bounds mask of their [ROWS, BLOCK_D] tile)."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    i_b = (pid_bh // H).to(tl.int64)
    i_h = (pid_bh % H).to(tl.int64)
    q_block = (pid_m * ROWS) // BLOCK_M
    o_m = pid_m * ROWS + tl.arange(0, ROWS)
    o_d = tl.arange(0, BLOCK_D)
    m_tile = (o_m < N)[:, None] & (o_d < HEAD_DIM)[None, :]
    return pid_m, pid_bh, i_b, i_h, q_block, o_m, o_d, m_tile


@triton.jit
def _tile_schedule(KvCount, KvIndex, i_b, i_h, q_block, stride_cb, stride_ch, stride_ib, stride_ih, stride_ir,
                   NUM_KV_BLOCKS, M, BLOCK_N: tl.constexpr):
    """The kept key blocks of query block q_block of (i_b, i_h). Index tables are ascending, so only the last kept
    key block can be the short last block of the sequence. Returns (the number of kept blocks, a pointer to the
    row of the index table, the number of full kept blocks, whether a short tail block follows, its index)."""
    count = tl.load(KvCount + i_b * stride_cb + i_h * stride_ch + q_block)
    p_index = KvIndex + i_b * stride_ib + i_h * stride_ih + q_block * stride_ir
    last_block = tl.load(p_index + tl.maximum(count - 1, 0))
    ragged_tail = (count > 0) & (last_block == NUM_KV_BLOCKS - 1) & (M % BLOCK_N != 0)
    return count, p_index, count - ragged_tail.to(tl.int32), ragged_tail, last_block


@triton.jit
def _store_rows(p_out, p_lse, b_acc, b_m, b_l, b_shift, m_tile, m_rows):
    """The forward's epilogue: out = b_acc / b_l (float32 [ROWS, BLOCK_D], in p_out's element type) and the rows'
    natural-log lse from the base-2 running max b_m, row sum b_l and shift b_shift (what the row's logits had
    taken off, base 2). A row with no kept key gives zeros and lse -inf; a NaN row sum (a non-finite input) gives
    NaN, as dense attention does. Returns b_l with rows without keys set to 1."""
    has_keys = b_l != 0.0
    b_l = tl.where(has_keys, b_l, 1.0)
    tl.store(p_out, (b_acc / b_l[:, None]).to(p_out.dtype.element_ty), mask=m_tile)
    tl.store(p_lse, tl.where(has_keys, (b_m + tl.math.log2(b_l) + b_shift) * LN2, float("-inf")), mask=m_rows)
    return b_l


@triton.jit
def _rows_source(X, i_b, i_h, stride_b, stride_h, USE_TMA: tl.constexpr):
    """What :func:`_load_rows` reads the [T, D] matrix of batch i_b, head i_h of X through: X itself when it
    is a tensor descriptor over [B, H, T, D] built by the launcher (USE_TMA), else that matrix's first
    element."""
    if USE_TMA:
        return X
    else:
        return X + i_b * stride_b + i_h * stride_h


@triton.jit
def _load_rows(source, start, stride_n, o_d, M, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SUB: tl.constexpr,
               MASK_COLS: tl.constexpr, TRANSPOSED: tl.constexpr, USE_TMA: tl.constexpr, i_b, i_h):
    """Rows [start, start + SUB) of a [M, D] matrix as [SUB, BLOCK_D] (or [BLOCK_D, SUB] when TRANSPOSED),
    from a source made by :func:`_rows_source`; rows past M and columns past HEAD_DIM read as zero (masked
    pointer loads only where they can occur: MASK_COLS for the sequence's last block, BLOCK_D > HEAD_DIM).
    Through a descriptor, one bulk copy of the [1, 1, SUB, HEAD_DIM] box at (i_b, i_h, start) (HEAD_DIM is
    then a power of two); the accelerator fills rows past M with zeros."""
    if USE_TMA:
        b_x = source.load([i_b.to(tl.int32), i_h.to(tl.int32), start, 0]).reshape(SUB, HEAD_DIM)
        if TRANSPOSED:
            b_x = tl.trans(b_x)
        return b_x
    else:
        o_rows = start + tl.arange(0, SUB)
        if TRANSPOSED:
            ptrs = source + o_rows[None, :].to(tl.int64) * stride_n + o_d[:, None]
            m_rows = (o_rows < M)[None, :]
            m_d = (o_d < HEAD_DIM)[:, None]
        else:
            ptrs = source + o_rows[:, None].to(tl.int64) * stride_n + o_d[None, :]
            m_rows = (o_rows < M)[:, None]
            m_d = (o_d < HEAD_DIM)[None, :]
        if MASK_COLS:
            return tl.load(ptrs, mask=m_rows & m_d, other=0.0)
        elif HEAD_DIM != BLOCK_D:
            return tl.load(ptrs, mask=m_d, other=0.0)
        else:
            return tl.load(ptrs)


# The interpreter cannot run PTX: there, _store_tile_lse is a plain tl.store.
_PTX_STORE = tl.constexpr(not INTERPRET)


@triton.jit
def _store_tile_lse(p_base, o_rows, b_m, b_psum):
    """Store a tile's row log-sum-exps b_m + log2(b_psum) (fp32 [ROWS]) at p_base + o_rows from the
    registers' own layout; made for the forward's pipelined loop. Through tl.store, the vector would first
    move to a coalesced layout through shared memory (a block-wide barrier per iteration), and libdevice's
    log2 adds a branch per element for subnormal inputs, which splits the loop body; one PTX block per
    element (approximate lg2, relative error ~2^-22, address math included) does neither. Threads holding
    copies store the same value."""
    if _PTX_STORE:
        tl.inline_asm_elementwise(
            "{ .reg .f32 t; .reg .b64 a; lg2.approx.f32 t, $4; add.f32 t, t, $3; mad.wide.s32 a, $2, 4, $1; "
            "st.global.f32 [a], t; mov.u32 $0, 0; }", "=r,l,r,f,f",
            [p_base.to(tl.int64, bitcast=True), o_rows, b_m, b_psum], dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.store(p_base + o_rows, b_m + tl.math.log2(b_psum))


@triton.jit
def _fwd_tile(b_acc, b_m, b_l, b_q, k_src, v_src, start_n, stride_kn, stride_vn, o_d, M, scale_log2, i_b, i_h,
              HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SUB_N: tl.constexpr, MASK_COLS: tl.constexpr,
              DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr):
    """SUB_N key columns of a kept tile: update the running max, sum and output accumulator."""
    b_kt = _load_rows(k_src, start_n, stride_kn, o_d, M, HEAD_DIM, BLOCK_D, SUB_N, MASK_COLS, True, USE_TMA,
                      i_b, i_h)
    b_v = _load_rows(v_src, start_n, stride_vn, o_d, M, HEAD_DIM, BLOCK_D, SUB_N, MASK_COLS, False, USE_TMA,
                     i_b, i_h)
    b_s = tl.dot(b_q, b_kt, input_precision=DOT_PRECISION)
    if MASK_COLS:
        b_s = tl.where((start_n + tl.arange(0, SUB_N) < M)[None, :], b_s, float("-inf"))
    b_m_new = tl.maximum(b_m, tl.max(b_s, 1) * scale_log2)
    b_p = tl.math.exp2(b_s * scale_log2 - b_m_new[:, None])
    b_alpha = tl.math.exp2(b_m - b_m_new)
    b_psum = tl.sum(b_p, 1)
    b_l = b_l * b_alpha + b_psum
    b_acc = b_acc * b_alpha[:, None]
    b_acc = tl.dot(b_p.to(b_v.dtype), b_v, b_acc, input_precision=DOT_PRECISION)
    return b_acc, b_m_new, b_l, b_psum


def _fwd_sub_rows(args: dict) -> int:
    """Keys per K/V load of the forward (its SUB): whole key blocks with tile masses, else SUB_N."""
    return args["BLOCK_N"] if args["WITH_MASS"] else args["SUB_N"]


@triton.autotune(configs=_configs("ROWS", "SUB_N", ((128, 64, 4, 2), (128, 64, 4, 3), (128, 64, 4, 4),
                                                   (128, 64, 8, 2, 128), (128, 128, 8, 2), (128, 128, 8, 3),
                                                   (64, 64, 4, 3), (64, 128, 4, 2)),
                                  _box_rows_hook(("K", "V"), _fwd_sub_rows)),
                 key=_TUNE_KEY + ["WITH_MASS"],
                 prune_configs_by=_prune("ROWS", "BLOCK_M", "SUB_N", "BLOCK_N", whole_tiles_flag="WITH_MASS"))
@triton.jit
def _bsa_fwd_kernel(Q, K, V, Out, Lse, KvCount, KvIndex, TileLse, TileMass,
                    stride_qb, stride_qh, stride_qn, stride_qd,
                    stride_kb, stride_kh, stride_kn,
                    stride_vb, stride_vh, stride_vn,
                    stride_ob, stride_oh, stride_on, stride_od,
                    stride_cb, stride_ch, stride_ib, stride_ih, stride_ir,
                    H, N, M, NUM_Q_BLOCKS, NUM_KV_BLOCKS, TILE_SLOTS, scale_log2,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, ROWS: tl.constexpr, SUB_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
                    WITH_MASS: tl.constexpr, USE_TMA: tl.constexpr):
    """Forward over the kept tiles of ROWS query rows. With WITH_MASS, also the exact softmax mass of each
    kept tile: every tile's row log-sum-exp (base 2) goes to the TileLse scratch [B*H, QB, TILE_SLOTS,
    BLOCK_M] (slot = 1 + position in the kv index table), and after the loop, once the rows' final lse is known,
    the program reads its slots back and writes its row of TileMass [BLOCK_M // ROWS, B*H, QB, KB] (the
    split of the query block it owns): sum_rows exp2(tile_lse - lse) / rows_in_block at kept key blocks, 0
    elsewhere. That variant walks whole tiles (no SUB_N sub-tiles), so the loop holds no branch and stays
    software-pipelined."""
    pid_m, pid_bh, i_b, i_h, q_block, o_m, o_d, m_tile = _program_rows(H, N, HEAD_DIM, BLOCK_D, BLOCK_M, ROWS)

    p_q = Q + i_b * stride_qb + i_h * stride_qh + o_m[:, None].to(tl.int64) * stride_qn + o_d[None, :] * stride_qd
    b_q = tl.load(p_q, mask=m_tile, other=0.0)
    SUB: tl.constexpr = BLOCK_N if WITH_MASS else SUB_N
    SUBS: tl.constexpr = BLOCK_N // SUB
    k_src = _rows_source(K, i_b, i_h, stride_kb, stride_kh, USE_TMA)
    v_src = _rows_source(V, i_b, i_h, stride_vb, stride_vh, USE_TMA)

    count, p_index, num_full, ragged_tail, last_block = _tile_schedule(
        KvCount, KvIndex, i_b, i_h, q_block, stride_cb, stride_ch, stride_ib, stride_ih, stride_ir, NUM_KV_BLOCKS, M,
        BLOCK_N)

    b_m = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([ROWS], dtype=tl.float32)
    b_acc = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
    if WITH_MASS:
        # Slot t + 1 holds tile t's row log-sum-exps (base 2): b_m + log2(b_psum), b_psum being the tile's row
        # sums relative to the running max right after it. The loop stores each tile's values one iteration late
        # (keeping the store off the critical path of the tile that produced it); slot 0 takes a dummy.
        o_in_block = (pid_m * ROWS) % BLOCK_M + tl.arange(0, ROWS)
        b_late_m = tl.zeros([ROWS], dtype=tl.float32)
        b_late_psum = tl.full([ROWS], 1.0, dtype=tl.float32)
        p_slots = TileLse + (pid_bh.to(tl.int64) * NUM_Q_BLOCKS + q_block) * TILE_SLOTS * BLOCK_M
        # This program's row of TileMass starts at zero (skipped tiles); its kept tiles are written last.
        split = ((pid_m * ROWS) % BLOCK_M) // ROWS
        mass_row = (split * tl.num_programs(1) + pid_bh).to(tl.int64) * NUM_Q_BLOCKS + q_block
        p_mass = TileMass + mass_row * NUM_KV_BLOCKS
        ZEROS: tl.constexpr = 512
        for c0 in range(0, NUM_KV_BLOCKS, ZEROS):
            o_c = c0 + tl.arange(0, ZEROS)
            tl.store(p_mass + o_c, tl.zeros([ZEROS], dtype=tl.float32), mask=o_c < NUM_KV_BLOCKS)
    for it in range(0, num_full * SUBS):
        start_n = tl.load(p_index + it // SUBS) * BLOCK_N + (it % SUBS) * SUB
        b_acc, b_m, b_l, b_psum = _fwd_tile(b_acc, b_m, b_l, b_q, k_src, v_src, start_n, stride_kn, stride_vn,
                                            o_d, M, scale_log2, i_b, i_h, HEAD_DIM, BLOCK_D, SUB, False,
                                            DOT_PRECISION, USE_TMA)
        if WITH_MASS:
            _store_tile_lse(p_slots + it * BLOCK_M, o_in_block, b_late_m, b_late_psum)
            b_late_m, b_late_psum = b_m, b_psum
    if WITH_MASS:
        tl.store(p_slots + num_full * BLOCK_M + o_in_block, b_late_m + tl.math.log2(b_late_psum))
    if ragged_tail:
        b_psum = tl.zeros([ROWS], dtype=tl.float32)  # the tail tile's row sums (WITH_MASS: one sub-tile)
        for sub in range(0, SUBS):
            start_n = last_block * BLOCK_N + sub * SUB
            if start_n < M:
                b_acc, b_m, b_l, b_psum = _fwd_tile(b_acc, b_m, b_l, b_q, k_src, v_src, start_n, stride_kn,
                                                    stride_vn, o_d, M, scale_log2, i_b, i_h, HEAD_DIM, BLOCK_D,
                                                    SUB, True, DOT_PRECISION, USE_TMA)
        if WITH_MASS:
            tl.store(p_slots + (num_full + 1) * BLOCK_M + o_in_block, b_m + tl.math.log2(b_psum))

    p_o = Out + i_b * stride_ob + i_h * stride_oh + o_m[:, None].to(tl.int64) * stride_on + o_d[None, :] * stride_od
    b_l = _store_rows(p_o, Lse + pid_bh.to(tl.int64) * N + o_m, b_acc, b_m, b_l, 0.0, m_tile, o_m < N)
    if WITH_MASS:
        # The barrier makes the other threads' tile sums visible, and orders the zeros before the masses.
        tl.debug_barrier()
        b_lse2 = b_m + tl.math.log2(b_l)
        rows_in_block = tl.minimum(BLOCK_M, N - q_block * BLOCK_M).to(tl.float32)
        # SLOTS kept tiles at a time: one [SLOTS, ROWS] load and one row reduction per chunk.
        SLOTS: tl.constexpr = 16
        for s0 in range(0, count, SLOTS):
            o_slot = s0 + tl.arange(0, SLOTS)
            m_slot = o_slot < count
            b_t = tl.load(p_slots + (o_slot[:, None] + 1) * BLOCK_M + o_in_block[None, :], mask=m_slot[:, None],
                          other=0.0)
            b_w = tl.where((o_m < N)[None, :], tl.math.exp2(b_t - b_lse2[None, :]), 0.0)
            cols = tl.load(p_index + o_slot, mask=m_slot, other=0)
            tl.store(p_mass + cols, tl.sum(b_w, 1) / rows_in_block, mask=m_slot)


@triton.jit
def _bsa_bwd_delta_kernel(Out, dOut, dLse, Delta, stride_ob, stride_oh, stride_on, stride_od,
                          stride_gb, stride_gh, stride_gn, stride_gd, H, N,
                          HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                          HAS_DLSE: tl.constexpr):
    """Delta = rowsum(dOut * Out) - dLse, float32 [B, H, N]."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    i_b = (pid_bh // H).to(tl.int64)
    i_h = (pid_bh % H).to(tl.int64)
    o_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_d = tl.arange(0, BLOCK_D)
    m_tile = (o_m < N)[:, None] & (o_d < HEAD_DIM)[None, :]
    b_o = tl.load(Out + i_b * stride_ob + i_h * stride_oh + o_m[:, None].to(tl.int64) * stride_on
                  + o_d[None, :] * stride_od, mask=m_tile, other=0.0).to(tl.float32)
    b_do = tl.load(dOut + i_b * stride_gb + i_h * stride_gh + o_m[:, None].to(tl.int64) * stride_gn
                   + o_d[None, :] * stride_gd, mask=m_tile, other=0.0).to(tl.float32)
    b_delta = tl.sum(b_o * b_do, 1)
    p_row = pid_bh.to(tl.int64) * N + o_m
    if HAS_DLSE:
        b_delta -= tl.load(dLse + p_row, mask=o_m < N, other=0.0)
    tl.store(Delta + p_row, b_delta, mask=o_m < N)


@triton.jit
def _dq_tile(b_dq, b_q, b_do, b_lse2, b_delta, k_src, v_src, start_n, stride_kn, stride_vn, o_d, M, scale_log2,
             i_b, i_h, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SUB_N: tl.constexpr, MASK_COLS: tl.constexpr,
             DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr):
    """SUB_N key columns of a kept tile in the dQ pass: recompute P and accumulate dS @ K."""
    b_kt = _load_rows(k_src, start_n, stride_kn, o_d, M, HEAD_DIM, BLOCK_D, SUB_N, MASK_COLS, True, USE_TMA,
                      i_b, i_h)
    b_vt = _load_rows(v_src, start_n, stride_vn, o_d, M, HEAD_DIM, BLOCK_D, SUB_N, MASK_COLS, True, USE_TMA,
                      i_b, i_h)
    b_s = tl.dot(b_q, b_kt, input_precision=DOT_PRECISION)
    b_p = tl.math.exp2(b_s * scale_log2 - b_lse2[:, None])
    if MASK_COLS:
        b_p = tl.where((start_n + tl.arange(0, SUB_N) < M)[None, :], b_p, 0.0)
    b_dp = tl.dot(b_do, b_vt, input_precision=DOT_PRECISION)
    b_ds = b_p * (b_dp - b_delta[:, None])
    return tl.dot(b_ds.to(b_kt.dtype), tl.trans(b_kt), b_dq, input_precision=DOT_PRECISION)


@triton.autotune(configs=_configs("ROWS", "SUB_N", ((128, 128, 8, 2), (128, 64, 8, 2), (128, 64, 4, 2), (128, 32, 4, 3),
                                                   (64, 64, 4, 2), (64, 128, 4, 2)),
                                  _box_rows_hook(("K", "V"), lambda a: a["SUB_N"])), key=_TUNE_KEY,
                 prune_configs_by=_prune("ROWS", "BLOCK_M", "SUB_N", "BLOCK_N"))
@triton.jit
def _bsa_bwd_dq_kernel(Q, K, V, dOut, Lse, Delta, dQ, KvCount, KvIndex,
                       stride_qb, stride_qh, stride_qn, stride_qd,
                       stride_kb, stride_kh, stride_kn,
                       stride_vb, stride_vh, stride_vn,
                       stride_gb, stride_gh, stride_gn, stride_gd,
                       stride_db, stride_dh, stride_dn, stride_dd,
                       stride_cb, stride_ch, stride_ib, stride_ih, stride_ir,
                       H, N, M, NUM_KV_BLOCKS, scale, scale_log2,
                       HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, ROWS: tl.constexpr, SUB_N: tl.constexpr,
                       DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr):
    _, pid_bh, i_b, i_h, q_block, o_m, o_d, m_tile = _program_rows(H, N, HEAD_DIM, BLOCK_D, BLOCK_M, ROWS)
    m_rows = o_m < N

    o_rows = o_m[:, None].to(tl.int64)
    b_q = tl.load(Q + i_b * stride_qb + i_h * stride_qh + o_rows * stride_qn + o_d[None, :] * stride_qd,
                  mask=m_tile, other=0.0)
    b_do = tl.load(dOut + i_b * stride_gb + i_h * stride_gh + o_rows * stride_gn + o_d[None, :] * stride_gd,
                   mask=m_tile, other=0.0)
    p_row = pid_bh.to(tl.int64) * N + o_m
    # Padding rows read lse = +inf so that their probabilities are exactly zero.
    b_lse2 = tl.load(Lse + p_row, mask=m_rows, other=float("inf")) * 1.4426950408889634
    b_delta = tl.load(Delta + p_row, mask=m_rows, other=0.0)
    k_src = _rows_source(K, i_b, i_h, stride_kb, stride_kh, USE_TMA)
    v_src = _rows_source(V, i_b, i_h, stride_vb, stride_vh, USE_TMA)

    count, p_index, num_full, ragged_tail, last_block = _tile_schedule(
        KvCount, KvIndex, i_b, i_h, q_block, stride_cb, stride_ch, stride_ib, stride_ih, stride_ir, NUM_KV_BLOCKS, M,
        BLOCK_N)

    SUBS: tl.constexpr = BLOCK_N // SUB_N
    b_dq = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
    for it in range(0, num_full * SUBS):
        start_n = tl.load(p_index + it // SUBS) * BLOCK_N + (it % SUBS) * SUB_N
        b_dq = _dq_tile(b_dq, b_q, b_do, b_lse2, b_delta, k_src, v_src, start_n, stride_kn, stride_vn, o_d, M,
                        scale_log2, i_b, i_h, HEAD_DIM, BLOCK_D, SUB_N, False, DOT_PRECISION, USE_TMA)
    if ragged_tail:
        for sub in range(0, SUBS):
            start_n = last_block * BLOCK_N + sub * SUB_N
            if start_n < M:
                b_dq = _dq_tile(b_dq, b_q, b_do, b_lse2, b_delta, k_src, v_src, start_n, stride_kn, stride_vn,
                                o_d, M, scale_log2, i_b, i_h, HEAD_DIM, BLOCK_D, SUB_N, True, DOT_PRECISION,
                                USE_TMA)
    p_dq = dQ + i_b * stride_db + i_h * stride_dh + o_rows * stride_dn + o_d[None, :] * stride_dd
    tl.store(p_dq, (b_dq * scale).to(dQ.dtype.element_ty), mask=m_tile)


@triton.autotune(configs=_configs("COLS", "SUB_M", ((64, 64, 4, 2), (64, 32, 4, 3), (64, 128, 4, 2), (128, 64, 8, 2),
                                                   (128, 32, 8, 2), (128, 64, 4, 2)),
                                  _box_rows_hook(("Q", "dOut"), lambda a: a["SUB_M"])), key=_TUNE_KEY,
                 prune_configs_by=_prune("COLS", "BLOCK_N", "SUB_M", "BLOCK_M"))
@triton.jit
def _bsa_bwd_dkdv_kernel(Q, K, V, dOut, Lse, Delta, dK, dV, QCount, QIndex,
                         stride_qb, stride_qh, stride_qn,
                         stride_kb, stride_kh, stride_kn, stride_kd,
                         stride_vb, stride_vh, stride_vn, stride_vd,
                         stride_gb, stride_gh, stride_gn,
                         stride_dkb, stride_dkh, stride_dkn, stride_dkd,
                         stride_dvb, stride_dvh, stride_dvn, stride_dvd,
                         stride_cb, stride_ch, stride_ib, stride_ih, stride_ir,
                         H, N, M, scale, scale_log2,
                         HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, COLS: tl.constexpr, SUB_M: tl.constexpr,
                         DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr):
    _, pid_bh, i_b, i_h, kv_block, o_n, o_d, m_tile = _program_rows(H, M, HEAD_DIM, BLOCK_D, BLOCK_N, COLS)

    o_cols = o_n[:, None].to(tl.int64)
    b_k = tl.load(K + i_b * stride_kb + i_h * stride_kh + o_cols * stride_kn + o_d[None, :] * stride_kd,
                  mask=m_tile, other=0.0)
    b_v = tl.load(V + i_b * stride_vb + i_h * stride_vh + o_cols * stride_vn + o_d[None, :] * stride_vd,
                  mask=m_tile, other=0.0)
    q_src = _rows_source(Q, i_b, i_h, stride_qb, stride_qh, USE_TMA)
    do_src = _rows_source(dOut, i_b, i_h, stride_gb, stride_gh, USE_TMA)
    p_rows = Lse + pid_bh.to(tl.int64) * N
    p_delta = Delta + pid_bh.to(tl.int64) * N

    count = tl.load(QCount + i_b * stride_cb + i_h * stride_ch + kv_block)
    p_index = QIndex + i_b * stride_ib + i_h * stride_ih + kv_block * stride_ir
    SUBS: tl.constexpr = BLOCK_M // SUB_M
    b_dk = tl.zeros([COLS, BLOCK_D], dtype=tl.float32)
    b_dv = tl.zeros([COLS, BLOCK_D], dtype=tl.float32)
    for it in range(0, count * SUBS):
        start_m = tl.load(p_index + it // SUBS) * BLOCK_M + (it % SUBS) * SUB_M
        o_rows = start_m + tl.arange(0, SUB_M)
        m_rows = o_rows < N
        # Transposed loads: rows are the head dim, columns the queries; padding queries read zeros.
        b_qt = _load_rows(q_src, start_m, stride_qn, o_d, N, HEAD_DIM, BLOCK_D, SUB_M, True, True, USE_TMA, i_b, i_h)
        b_do = _load_rows(do_src, start_m, stride_gn, o_d, N, HEAD_DIM, BLOCK_D, SUB_M, True, False, USE_TMA, i_b,
                          i_h)
        # Padding queries read lse = +inf so that their probabilities are exactly zero.
        b_lse2 = tl.load(p_rows + o_rows, mask=m_rows, other=float("inf")) * 1.4426950408889634
        b_delta = tl.load(p_delta + o_rows, mask=m_rows, other=0.0)
        b_pt = tl.math.exp2(tl.dot(b_k, b_qt, input_precision=DOT_PRECISION) * scale_log2 - b_lse2[None, :])
        b_dv = tl.dot(b_pt.to(b_do.dtype), b_do, b_dv, input_precision=DOT_PRECISION)
        b_dpt = tl.dot(b_v, tl.trans(b_do), input_precision=DOT_PRECISION)
        b_dst = b_pt * (b_dpt - b_delta[None, :])
        b_dk = tl.dot(b_dst.to(b_qt.dtype), tl.trans(b_qt), b_dk, input_precision=DOT_PRECISION)
    tl.store(dK + i_b * stride_dkb + i_h * stride_dkh + o_cols * stride_dkn + o_d[None, :] * stride_dkd,
             (b_dk * scale).to(dK.dtype.element_ty), mask=m_tile)
    tl.store(dV + i_b * stride_dvb + i_h * stride_dvh + o_cols * stride_dvn + o_d[None, :] * stride_dvd,
             b_dv.to(dV.dtype.element_ty), mask=m_tile)


# --------------------------------------------------------------------------- launchers

# The autotuned kernels by pass, for tools that inspect or reset their tuning (benchmarks).
AUTOTUNED_KERNELS = {"fwd": _bsa_fwd_kernel, "dq": _bsa_bwd_dq_kernel, "dkdv": _bsa_bwd_dkdv_kernel}


def _alloc(like: torch.Tensor, shape: tuple[int, ...] | None = None, dtype: torch.dtype | None = None):
    """Uninitialised kernel output: like's shape, dtype and layout, or a contiguous ``shape``/``dtype``
    tensor on like's device. Every kernel output is allocated here (tests poison it with NaN)."""
    if shape is None:
        return torch.empty_like(like)
    return torch.empty(shape, device=like.device, dtype=dtype)


def padded_pow2(n: int) -> int:
    """The smallest power of two >= n and >= 16 (a tl.arange extent)."""
    return max(16, triton.next_power_of_2(n))


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs keep fp32 accuracy (like PyTorch's default matmul); half types use the tensor cores.
    return "ieee" if dtype == torch.float32 else "tf32"


def _unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    """The kernels read the head dim contiguously; views with a strided head dim (rare) are copied."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _use_tma(kernel: str, *tensors: torch.Tensor) -> bool:
    """Whether ``kernel`` reads these [B, H, T, D] tensors through tensor descriptors: enabled in ``TMA``, a
    Hopper or newer GPU (or the interpreter), a power-of-two head dim >= 16, unit stride over D, and a
    16-byte aligned base and strides."""
    first = tensors[0]
    if kernel not in TMA or not (INTERPRET or (first.is_cuda and _hopper_or_newer(first.device.index))):
        return False
    d = first.shape[-1]
    if d < 16 or d & (d - 1):
        return False
    return all(t.stride(-1) == 1 and t.data_ptr() % 16 == 0
               and all(stride * t.element_size() % 16 == 0 for stride in t.stride()[:-1]) for t in tensors)


@functools.lru_cache(maxsize=None)
def _hopper_or_newer(device_index: int | None) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def _sources(use_tma: bool, *tensors: torch.Tensor) -> tuple:
    """What a kernel reads these [B, H, T, D] tensors through: tensor descriptors built once per call (their
    box rows set per config by :func:`_box_rows_hook`), or the tensors themselves."""
    if not use_tma:
        return tensors
    return tuple(TensorDescriptor.from_tensor(t, [1, 1, 16, t.shape[-1]]) for t in tensors)


def _table_strides(count: torch.Tensor, index: torch.Tensor, batch: int, heads: int) -> tuple[int, ...]:
    """Strides (batch, head) of the count table and (batch, head, row) of the index table; 0 where broadcast."""
    cb = count.stride(0) if count.shape[0] == batch and batch > 1 else 0
    ch = count.stride(1) if count.shape[1] == heads and heads > 1 else 0
    ib = index.stride(0) if index.shape[0] == batch and batch > 1 else 0
    ih = index.stride(1) if index.shape[1] == heads and heads > 1 else 0
    return cb, ch, ib, ih, index.stride(2)


def triton_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_count: torch.Tensor,
                   kv_index: torch.Tensor, block_q: int, block_k: int, scale: float,
                   with_tile_mass: bool = False, tile_slots: int = 0) -> tuple[torch.Tensor, ...]:
    """Launch the forward kernel. q: [B, H, N, D], k/v: [B, H, M, D] (any strides), tables from SparseMask.

    Returns out (q's dtype, q's layout) and lse float32 [B, H, N] (natural log); with ``with_tile_mass``
    also the exact softmax mass of each tile, float32 [B, H, QB, KB] (mean over the query block's rows of
    the probability the row gives the tile's keys; 0 for skipped tiles). That variant needs ``tile_slots`` >=
    ``kv_count.max()`` (``SparseMask.max_kept_blocks``, a host int: no device read here) to size a scratch of
    B*H*QB*(tile_slots + 1)*block_q floats.
    """
    q, k, v = (_unit_last_stride(t) for t in (q, k, v))
    b, h, n, d = q.shape
    m = k.shape[2]
    qb, kb = kv_index.shape[-2], kv_index.shape[-1]
    out = _alloc(q)
    lse = _alloc(q, (b, h, n), torch.float32)
    slots = tile_slots + 1 if with_tile_mass else 0  # slot 0 of each row is the kernel's dummy
    tile_lse = _alloc(q, (b * h * qb * slots * block_q,), torch.float32) if with_tile_mass else lse
    tile_mass = _alloc(q, (block_q // 64, b, h, qb, kb), torch.float32) if with_tile_mass else lse
    use_tma = _use_tma("fwd", k, v)
    # The tuning key beyond the constexprs: N, M, the dtypes (q, k, v share one; the rest are fixed) and the device.
    config = launch_tuned(
        _bsa_fwd_kernel, lambda meta: (triton.cdiv(n, meta["ROWS"]), b * h), (n, m, q.dtype, q.device),
        q, *_sources(use_tma, k, v), out, lse, kv_count, kv_index, tile_lse, tile_mass,
        *q.stride(), *k.stride()[:3], *v.stride()[:3], *out.stride(),
        *_table_strides(kv_count, kv_index, b, h),
        h, n, m, qb, kb, slots, scale * LOG2E,
        HEAD_DIM=d, BLOCK_D=padded_pow2(d), BLOCK_M=block_q, BLOCK_N=block_k,
        DOT_PRECISION=_dot_precision(q.dtype), WITH_MASS=with_tile_mass, USE_TMA=use_tma,
    )
    if not with_tile_mass:
        return out, lse
    # Programs owning ROWS rows wrote the first block_q // ROWS splits, each over every tile.
    splits = block_q // config.kwargs["ROWS"]
    return out, lse, tile_mass[0] if splits == 1 else tile_mass[:splits].sum(dim=0)


def triton_backward(grad_out: torch.Tensor, grad_lse: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor,
                    v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, kv_count: torch.Tensor,
                    kv_index: torch.Tensor, q_count: torch.Tensor, q_index: torch.Tensor, block_q: int,
                    block_k: int, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the backward kernels. Returns dq, dk, dv in the dtypes and layouts of q, k, v."""
    q, k, v, out, grad_out = (_unit_last_stride(t) for t in (q, k, v, out, grad_out))
    b, h, n, d = q.shape
    m = k.shape[2]
    block_d = padded_pow2(d)
    precision = _dot_precision(q.dtype)
    delta = _alloc(q, (b, h, n), torch.float32)
    has_dlse = grad_lse is not None
    _bsa_bwd_delta_kernel[(triton.cdiv(n, 128), b * h)](
        out, grad_out, grad_lse.contiguous() if has_dlse else delta, delta,
        *out.stride(), *grad_out.stride(), h, n,
        HEAD_DIM=d, BLOCK_D=block_d, BLOCK_M=128, HAS_DLSE=has_dlse,
    )
    dq, dk, dv = _alloc(q), _alloc(k), _alloc(v)
    dq_tma, dkdv_tma = _use_tma("dq", k, v), _use_tma("dkdv", q, grad_out)
    _bsa_bwd_dq_kernel[lambda meta: (triton.cdiv(n, meta["ROWS"]), b * h)](
        q, *_sources(dq_tma, k, v), grad_out, lse, delta, dq, kv_count, kv_index,
        *q.stride(), *k.stride()[:3], *v.stride()[:3], *grad_out.stride(), *dq.stride(),
        *_table_strides(kv_count, kv_index, b, h),
        h, n, m, kv_index.shape[-1], scale, scale * LOG2E,
        HEAD_DIM=d, BLOCK_D=block_d, BLOCK_M=block_q, BLOCK_N=block_k, DOT_PRECISION=precision, USE_TMA=dq_tma,
    )
    q_source, do_source = _sources(dkdv_tma, q, grad_out)
    _bsa_bwd_dkdv_kernel[lambda meta: (triton.cdiv(m, meta["COLS"]), b * h)](
        q_source, k, v, do_source, lse, delta, dk, dv, q_count, q_index,
        *q.stride()[:3], *k.stride(), *v.stride(), *grad_out.stride()[:3], *dk.stride(), *dv.stride(),
        *_table_strides(q_count, q_index, b, h),
        h, n, m, scale, scale * LOG2E,
        HEAD_DIM=d, BLOCK_D=block_d, BLOCK_M=block_q, BLOCK_N=block_k, DOT_PRECISION=precision, USE_TMA=dkdv_tma,
    )
    return dq, dk, dv
