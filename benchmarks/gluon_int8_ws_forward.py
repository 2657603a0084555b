"""The int8 forward warp-specialised, in Gluon: FlashAttention-3's schedule on sparsevid's block-sparse tables.

One program owns 128 query rows (a query block, or part of one) and runs three partitions:

    producer (1 warp):     for each pair of kept 64-key sub-tiles, TMA loads of their K (int8) and V (e4m3,
                           tokens contiguous) into a ring of NUM_STAGES slots; a slot is reused once both
                           consumers have released it (mbarriers "ready" and "empty")
    consumer 0 (4 warps):  rows 0-63 of the 128, the library's two-tile step (one row max and one rescale of the
    consumer 1 (4 warps):  rows 64-127            accumulator per pair, the pair's P V summed from zero by the
                                                   tensor cores and folded into the fp32 accumulator by an FMA)

Measured (``python -m benchmarks ws_int8_limits``, H100, c95893f): level with the library's Triton forward at the
Wan 1.3B shape at 95% (0.604 against 0.587 ms), 7% faster at Wan 14B (9.16 against 9.89 ms) and 4% with the full
mask; why it is not faster: benchmarks/NOTES.md, "FlashAttention-3's schedule in Gluon".

The two consumers read the same K and V tiles, so a tile crosses from L2 into shared memory once per 128 rows
(the Triton forward's programs own 64 rows and load their own), and each consumer has 240 registers (the producer
gives its share back), so the fresh P V product beside the accumulator does not spill. Inside a consumer each
step issues the previous pair's P V and this pair's Q K^T asynchronously, folds the P V while Q K^T runs, then
runs the softmax, whose P goes through shared memory to the next step's P V (carried in registers as e4m3, its
bytes were unpacked and repacked at every iteration); the other consumer's tensor-core work fills the softmax's time
(ping-pong left to the warp schedulers). The producer also writes each pair's K scales and first keys into shared
memory, so the consumers' loop reads no global memory. ``persistent`` programs loop over (head, 128 rows) items,
one program per SM, so the prologue (barriers, the warp groups' register handover) is paid once per SM.

Arithmetic: the library's (``sparsevid.ops.triton_int8_attention``: int8 Q K^T, Q per row and K per key block,
V per head in e4m3, P * P_SCALE in e4m3, base-2 online softmax), with the pairs taken in the row's order across
the sequence's short last block (the library steps over that block's sub-tiles one at a time), so the outputs
agree with the library's to float32 rounding, not bit for bit.

Inputs as :func:`supported` accepts them: a Hopper GPU, head dim 64 or 128, query blocks of a multiple of 128
rows, 64- or 128-key blocks; q8 and k8 contiguous, v8 as ``quantize`` makes it. Descriptors are 2-D over the
flattened heads: a key tile past M reads the next head's first keys (finite int8, masked to -inf), V's columns
past M are zero-filled by the copy engine, query rows past N are not stored.
"""
from __future__ import annotations

import math

import torch
import triton

from sparsevid.ops import triton_attention as bf16
from sparsevid.ops.fp8 import P_SCALE
from sparsevid.ops.int8 import Int8Inputs, Int8Queries
from sparsevid.ops.triton_attention import LOG2E
from sparsevid.ops.triton_launch import INTERPRET

from .gluon_int8_forward import v_buffer_rows

try:  # Gluon and its Hopper ops ship with Triton >= 3.5
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                 warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton
    gluon = None

GROUP_ROWS = 128  # query rows per program: two consumer warp groups of 64
HALF_ROWS = 64
SUB = 64  # keys per sub-tile (a 128-key block is two)
HEAD_DIMS = (64, 128)
MAXNREG = 168  # 12 warps (two consumer warp groups, one producer warp rounded up to a group) x 168 = 64,512 regs

if gluon is not None:
    _LOG2_P_SCALE = gl.constexpr(math.log2(P_SCALE))
    _LN2 = gl.constexpr(math.log(2.0))
    _GROUP_ROWS = gl.constexpr(GROUP_ROWS)
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    # the partition's barrier: gl.thread_barrier in Triton 3.6, gl.barrier later
    _barrier = getattr(gl, "thread_barrier", None) or gl.barrier

    @gluon.jit
    def _work_item(w, ROW_GROUPS, H):
        """Item w: its head (b*H + h), batch, head and first query row; items of one head are consecutive, so the
        programs running at once share that head's K and V in L2."""
        pid_bh = w // ROW_GROUPS
        row0 = (w % ROW_GROUPS) * _GROUP_ROWS
        return pid_bh, pid_bh // H, pid_bh % H, row0

    @gluon.jit
    def _row_schedule(KvCount, KvIndex, i_b, i_h, q_block, stride_cb, stride_ch, stride_ib, stride_ih, stride_ir,
                      NUM_KV_BLOCKS, M, BLOCK_N: gl.constexpr):
        """The kept sub-tiles of query block q_block: (a pointer to its index row, how many 64-key sub-tiles).
        Tables are ascending: only the last kept block can be the sequence's short last one, whose sub-tiles past
        M are not counted."""
        SUBS: gl.constexpr = BLOCK_N // 64
        count = gl.load(KvCount + i_b * stride_cb + i_h * stride_ch + q_block)
        p_index = KvIndex + i_b * stride_ib + i_h * stride_ih + q_block * stride_ir
        last = gl.load(p_index + gl.maximum(count - 1, 0))
        ragged = ((count > 0) & (last == NUM_KV_BLOCKS - 1)).to(gl.int32) * (M % BLOCK_N != 0).to(gl.int32)
        tail_subs = (M % BLOCK_N + 63) // 64
        return p_index, count * SUBS - ragged * (SUBS - tail_subs)

    @gluon.jit
    def _sub_block(p_index, t, BLOCK_N: gl.constexpr):
        """Sub-tile t of a row: (its key block, its first key)."""
        SUBS: gl.constexpr = BLOCK_N // 64
        block = gl.load(p_index + t // SUBS)
        return block, block * BLOCK_N + (t % SUBS) * 64

    @gluon.jit
    def _producer(k_desc, v_desc, k_smem, v_smem, meta_smem, ready, empty, KScale, KvCount, KvIndex,
                  stride_cb, stride_ch, stride_ib, stride_ih, stride_ir, H, M, NUM_KV_BLOCKS, ROW_GROUPS, TOTAL,
                  HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr):
        """TMA loads of every item's pairs of sub-tiles into the slots, in the consumers' order, and each pair's
        K scales and first keys into meta_smem (float32 [NUM_STAGES, 1, 4]: scale a, scale b, key a, key b), so
        that the consumers read no global memory in their loop."""
        nbytes: gl.constexpr = 2 * (k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        meta_layout: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [1, gl.num_warps()], [1, 0])
        o_meta = gl.arange(0, 4, layout=gl.SliceLayout(0, meta_layout))[None, :]
        c = 0  # pairs issued so far (over all items): slot c % NUM_STAGES, its use number c // NUM_STAGES
        for w in range(gl.program_id(0), TOTAL, gl.num_programs(0)):
            pid_bh, i_b, i_h, row0 = _work_item(w, ROW_GROUPS, H)
            p_index, num_subs = _row_schedule(KvCount, KvIndex, i_b, i_h, row0 // BLOCK_M, stride_cb, stride_ch,
                                              stride_ib, stride_ih, stride_ir, NUM_KV_BLOCKS, M, BLOCK_N)
            p_kscale = KScale + pid_bh.to(gl.int64) * NUM_KV_BLOCKS
            kv_row0 = pid_bh * M
            vd_row0 = pid_bh * HEAD_DIM
            for i in range((num_subs + 1) // 2):
                block_a, start_a = _sub_block(p_index, 2 * i, BLOCK_N)
                # an odd row's last pair loads its one sub-tile twice (finite values; the consumers weigh it 0)
                block_b, start_b = _sub_block(p_index, gl.minimum(2 * i + 1, num_subs - 1), BLOCK_N)
                ks_a = gl.load(p_kscale + block_a)
                ks_b = gl.load(p_kscale + block_b)
                slot = c % NUM_STAGES
                # a fresh barrier counts as having completed the phase before 0: the first round does not wait
                mbarrier.wait(empty.index(slot), ((c // NUM_STAGES) & 1) ^ 1)
                meta = gl.where(o_meta == 0, ks_a, gl.where(o_meta == 1, ks_b, gl.where(
                    o_meta == 2, start_a.to(gl.float32), start_b.to(gl.float32))))
                meta_smem.index(slot).store(meta)
                _barrier()  # every lane's store before the arrival that releases the slot
                bar = ready.index(slot)
                mbarrier.expect(bar, nbytes)
                _tma_load(k_desc, [kv_row0 + start_a, 0], bar, k_smem.index(2 * slot))
                _tma_load(k_desc, [kv_row0 + start_b, 0], bar, k_smem.index(2 * slot + 1))
                _tma_load(v_desc, [vd_row0, start_a], bar, v_smem.index(2 * slot))
                _tma_load(v_desc, [vd_row0, start_b], bar, v_smem.index(2 * slot + 1))
                c += 1

    @gluon.jit
    def _logits(b_s, start, M, o_n, MASKED: gl.constexpr):
        """int32 logits of a sub-tile from key ``start`` as float32 (exact: |logit| <= 127^2 * D < 2^24); where
        MASKED, keys past M at -inf."""
        b_f = b_s.to(gl.float32)
        if MASKED:
            b_f = gl.where((start + o_n < M)[None, :], b_f, float("-inf"))
        return b_f

    @gluon.jit
    def _entry(meta, o_meta, j: gl.constexpr):
        """Entry j of a pair's [1, 4] record (every thread holds all of it) as a scalar."""
        return gl.sum(gl.sum(gl.where(o_meta == j, meta, 0.0), 1), 0)

    @gluon.jit
    def _issue_pv(p_smem, v_smem, slot, o_zero):
        """The P V product of the pair in ``slot`` (P from p_smem, from zero), issued asynchronously."""
        pv = warpgroup_mma(p_smem.index(0), v_smem.index(2 * slot).permute((1, 0)), o_zero, use_acc=False,
                           is_async=True)
        return warpgroup_mma(p_smem.index(1), v_smem.index(2 * slot + 1).permute((1, 0)), pv, is_async=True)

    @gluon.jit
    def _pair_step(b_m, b_l, b_acc, b_fold, i, c, num_subs, b_rs, q_smem, p_smem, k_smem, v_smem, meta_smem,
                   ready, empty, M, o_n, s_zero, o_zero, NUM_STAGES: gl.constexpr, MASKED: gl.constexpr):
        """Pair i of the row (pair c over the program's items): issue the pair before's P V (P from p_smem, from
        zero) and this pair's Q K^T, fold that P V into the accumulator while Q K^T runs, then the softmax, whose
        P (e4m3) goes to p_smem for the next step. MASKED: the row's last pair, whose keys past M and, in a row
        with an odd number of sub-tiles, whose second sub-tile (the first loaded again) weigh 0."""
        slot = c % NUM_STAGES
        prev = (c - (i > 0).to(gl.int32)) % NUM_STAGES  # the pair before's slot (this one's at i = 0)
        mbarrier.wait(ready.index(slot), (c // NUM_STAGES) & 1)
        # the pair's K scales and first keys, as the producer wrote them (every thread holds all four)
        meta_layout: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [1, gl.num_warps()], [1, 0])
        meta = meta_smem.index(slot).load(meta_layout)
        o_meta = gl.arange(0, 4, layout=gl.SliceLayout(0, meta_layout))[None, :]
        rs_a = b_rs * _entry(meta, o_meta, 0)
        rs_b = b_rs * _entry(meta, o_meta, 1)
        pv = _issue_pv(p_smem, v_smem, prev, o_zero)
        s_a = warpgroup_mma(q_smem, k_smem.index(2 * slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s_b = warpgroup_mma(q_smem, k_smem.index(2 * slot + 1).permute((1, 0)), s_zero, use_acc=False,
                            is_async=True)
        b_pv = warpgroup_mma_wait(2, deps=[pv])
        mbarrier.arrive(empty.index(prev), pred=i > 0)  # the pair before's tiles are no longer read
        b_acc = gl.fma(b_acc, b_fold[:, None], b_pv)
        b_sa, b_sb = warpgroup_mma_wait(0, deps=[s_a, s_b])

        if MASKED:
            start_a = _entry(meta, o_meta, 2).to(gl.int32)
            start_b = _entry(meta, o_meta, 3).to(gl.int32)
        else:
            start_a = 0
            start_b = 0
        b_fa = _logits(b_sa, start_a, M, o_n, MASKED)
        b_fb = _logits(b_sb, start_b, M, o_n, MASKED)
        if MASKED:
            if 2 * i + 1 >= num_subs:
                b_fb = gl.full(b_fb.shape, float("-inf"), gl.float32, b_fb.type.layout)
        b_m_new = gl.maximum(b_m, gl.maximum(gl.max(b_fa, 1) * rs_a, gl.max(b_fb, 1) * rs_b) - _LOG2_P_SCALE)
        p_a = gl.exp2(gl.fma(b_fa, rs_a[:, None], -b_m_new[:, None]))
        p_b = gl.exp2(gl.fma(b_fb, rs_b[:, None], -b_m_new[:, None]))
        b_alpha = gl.exp2(b_m - b_m_new)
        b_l = b_l * b_alpha + gl.sum(p_a, 1) + gl.sum(p_b, 1)
        p_smem.index(0).store(p_a.to(gl.float8e4nv))
        p_smem.index(1).store(p_b.to(gl.float8e4nv))
        fence_async_shared()
        return b_m_new, b_l, b_acc, gl.convert_layout(b_alpha, b_fold.type.layout)

    @gluon.jit
    def _consumer(q_desc, q_smem, q_bar, p_smem, k_smem, v_smem, meta_smem, ready, empty, QScale, QShift, VScale,
                  Out, Lse, KvCount, KvIndex, stride_ob, stride_oh, stride_on, stride_od,
                  stride_cb, stride_ch, stride_ib, stride_ih, stride_ir,
                  H, N, M, NUM_KV_BLOCKS, ROW_GROUPS, TOTAL, scale_log2,
                  HALF: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                  NUM_STAGES: gl.constexpr):
        """Rows HALF * 64 to HALF * 64 + 63 of every item: the online softmax over the pairs the producer loads;
        P passes through p_smem (two e4m3 [64, 64] tiles), the left operand of the next step's P V."""
        WARPS: gl.constexpr = gl.num_warps()
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                           instr_shape=[16, 64, 32])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                           instr_shape=[16, HEAD_DIM, 32])
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        s_zero = gl.zeros([64, 64], gl.int32, s_layout)
        o_zero = gl.zeros([64, HEAD_DIM], gl.float32, o_layout)
        p_zero = gl.zeros([64, 64], gl.float32, s_layout).to(gl.float8e4nv)
        o_n = gl.arange(0, 64, layout=gl.SliceLayout(0, s_layout))
        o_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))

        c = 0  # pairs consumed so far (over all items), as the producer counts them
        item = 0
        for w in range(gl.program_id(0), TOTAL, gl.num_programs(0)):
            pid_bh, i_b, i_h, row0 = _work_item(w, ROW_GROUPS, H)
            row0 = row0 + HALF * 64
            _, num_subs = _row_schedule(KvCount, KvIndex, i_b, i_h, row0 // BLOCK_M, stride_cb, stride_ch,
                                        stride_ib, stride_ih, stride_ir, NUM_KV_BLOCKS, M, BLOCK_N)
            mbarrier.expect(q_bar, q_desc.block_type.nbytes)
            _tma_load(q_desc, [pid_bh * N + row0, 0], q_bar, q_smem)
            o_m = row0 + gl.arange(0, 64, layout=row_s)
            p_rows = pid_bh.to(gl.int64) * N + o_m
            b_rs = gl.load(QScale + p_rows, mask=o_m < N, other=1.0) * scale_log2
            b_m = gl.full([64], float("-inf"), gl.float32, row_s)
            b_l = gl.zeros([64], gl.float32, row_s)
            b_acc = gl.zeros([64, HEAD_DIM], gl.float32, o_layout)
            b_fold = gl.zeros([64], gl.float32, row_o)
            # P before the first pair: zeros (its product with the first pair's V adds nothing)
            p_smem.index(0).store(p_zero)
            p_smem.index(1).store(p_zero)
            fence_async_shared()
            mbarrier.wait(q_bar, item & 1)
            num_pairs = (num_subs + 1) // 2
            for i in range(num_pairs - 1):
                b_m, b_l, b_acc, b_fold = _pair_step(b_m, b_l, b_acc, b_fold, i, c, num_subs, b_rs, q_smem, p_smem,
                                                     k_smem, v_smem, meta_smem, ready, empty, M, o_n, s_zero, o_zero,
                                                     NUM_STAGES, False)
                c += 1
            if num_pairs > 0:  # the last pair, masked, then its product
                b_m, b_l, b_acc, b_fold = _pair_step(b_m, b_l, b_acc, b_fold, num_pairs - 1, c, num_subs, b_rs,
                                                     q_smem, p_smem, k_smem, v_smem, meta_smem, ready, empty, M, o_n,
                                                     s_zero, o_zero, NUM_STAGES, True)
                last = c % NUM_STAGES
                c += 1
                b_pv = warpgroup_mma_wait(0, deps=[_issue_pv(p_smem, v_smem, last, o_zero)])
                mbarrier.arrive(empty.index(last))
                b_acc = gl.fma(b_acc, b_fold[:, None], b_pv)

            # the library's epilogue: rows without keys give zeros and lse -inf
            b_shift = gl.load(QShift + p_rows, mask=o_m < N, other=0.0) * scale_log2
            has_keys = b_l != 0.0
            b_l = gl.where(has_keys, b_l, 1.0)
            gl.store(Lse + p_rows, gl.where(has_keys, (b_m + gl.log2(b_l) + b_shift) * _LN2, float("-inf")),
                     mask=o_m < N)
            o_mo = row0 + gl.arange(0, 64, layout=row_o)
            b_out = b_acc * (gl.load(VScale + pid_bh) / gl.convert_layout(b_l, row_o))[:, None]
            p_o = (Out + i_b.to(gl.int64) * stride_ob + i_h.to(gl.int64) * stride_oh
                   + o_mo[:, None].to(gl.int64) * stride_on + o_d[None, :] * stride_od)
            gl.store(p_o, b_out.to(Out.dtype.element_ty), mask=(o_mo < N)[:, None])
            item += 1

    @gluon.jit
    def _ws_int8_fwd_kernel(q_desc, k_desc, v_desc, QScale, QShift, KScale, VScale, Out, Lse, KvCount, KvIndex,
                            stride_ob, stride_oh, stride_on, stride_od,
                            stride_cb, stride_ch, stride_ib, stride_ih, stride_ir,
                            H, N, M, NUM_KV_BLOCKS, ROW_GROUPS, TOTAL, scale_log2,
                            HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                            NUM_STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr):
        """Programs over items w = (b*H + h) * ROW_GROUPS + (128-row group), TOTAL of them, each program taking
        every num_programs-th; q8 by descriptor over [B*H*N, D] (64-row boxes), k8 over [B*H*M, D], v8 over
        [B*H*D, M] (tokens contiguous). Writes Out [B, H, N, D] (any strides) and Lse float32 [B, H, N]."""
        q_smem = gl.allocate_shared_memory(q_desc.dtype, [2] + q_desc.block_type.shape, q_desc.layout)
        p_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 64], gl.float8e4nv)
        p_smem0 = gl.allocate_shared_memory(gl.float8e4nv, [2, 64, 64], p_layout)
        p_smem1 = gl.allocate_shared_memory(gl.float8e4nv, [2, 64, 64], p_layout)
        k_smem = gl.allocate_shared_memory(k_desc.dtype, [2 * NUM_STAGES] + k_desc.block_type.shape, k_desc.layout)
        v_smem = gl.allocate_shared_memory(v_desc.dtype, [2 * NUM_STAGES] + v_desc.block_type.shape, v_desc.layout)
        meta_smem = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, 1, 4],
                                              gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        q_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(q_bars.index(i), count=1)
        for i in gl.static_range(NUM_STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)  # both consumers release a slot
        fence_async_shared()

        # (the partitions' argument tuples written out: a tuple concatenation would unwrap the constexprs)
        gl.warp_specialize([
            (_consumer, (q_desc, q_smem.index(0), q_bars.index(0), p_smem0, k_smem, v_smem, meta_smem, ready,
                         empty, QScale, QShift, VScale, Out, Lse, KvCount, KvIndex, stride_ob, stride_oh, stride_on,
                         stride_od,
                         stride_cb, stride_ch, stride_ib, stride_ih, stride_ir, H, N, M, NUM_KV_BLOCKS, ROW_GROUPS,
                         TOTAL, scale_log2, 0, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_STAGES)),
            (_consumer, (q_desc, q_smem.index(1), q_bars.index(1), p_smem1, k_smem, v_smem, meta_smem, ready,
                         empty, QScale, QShift, VScale, Out, Lse, KvCount, KvIndex, stride_ob, stride_oh, stride_on,
                         stride_od,
                         stride_cb, stride_ch, stride_ib, stride_ih, stride_ir, H, N, M, NUM_KV_BLOCKS, ROW_GROUPS,
                         TOTAL, scale_log2, 1, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_STAGES)),
            (_producer, (k_desc, v_desc, k_smem, v_smem, meta_smem, ready, empty, KScale, KvCount, KvIndex,
                         stride_cb, stride_ch, stride_ib, stride_ih, stride_ir, H, M, NUM_KV_BLOCKS, ROW_GROUPS, TOTAL,
                         HEAD_DIM, BLOCK_M, BLOCK_N, NUM_STAGES)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


def supported(qx: Int8Queries, x: Int8Inputs, block_q: int, block_k: int) -> bool:
    """Whether :func:`ws_int8_forward` takes these inputs (see the module's docstring)."""
    q8, k8 = qx.q8, x.k8
    if gluon is None or INTERPRET or not q8.is_cuda or torch.cuda.get_device_capability(q8.device)[0] != 9:
        return False
    return (q8.shape[-1] in HEAD_DIMS and block_k in (64, 128) and block_q % GROUP_ROWS == 0
            and q8.is_contiguous() and k8.is_contiguous() and x.k_scale.is_contiguous()
            and v_buffer_rows(x.v8) is not None)


def ws_int8_forward(qx: Int8Queries, x: Int8Inputs, kv_count: torch.Tensor, kv_index: torch.Tensor,
                    block_q: int, block_k: int, scale: float, like: torch.Tensor, stages: int = 3,
                    persistent: bool = True, consumer_regs: int = 240, producer_regs: int = 24
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``int8_forward`` on inputs :func:`supported` accepts, ``stages`` pairs of K/V sub-tiles in flight:
    out [B, H, N, D] (like's dtype and layout) and lse float32 [B, H, N] (natural log). ``persistent``: one
    program per SM looping over the items, else one program per item."""
    b, h, n, d = qx.q8.shape
    m = x.k8.shape[2]
    out = bf16._alloc(like)
    lse = bf16._alloc(like, (b, h, n), torch.float32)

    def descriptor(t: torch.Tensor, box: list[int], dtype) -> TensorDescriptor:
        return TensorDescriptor(t, list(t.shape), list(t.stride()), box,
                                gl.NVMMASharedLayout.get_default_for(box, dtype))

    q_desc = descriptor(qx.q8.view(b * h * n, d), [HALF_ROWS, d], gl.int8)
    k_desc = descriptor(x.k8.view(b * h * m, d), [SUB, d], gl.int8)
    v_desc = descriptor(v_buffer_rows(x.v8), [d, SUB], gl.float8e4nv)
    row_groups = triton.cdiv(n, GROUP_ROWS)
    total = b * h * row_groups
    sms = torch.cuda.get_device_properties(like.device).multi_processor_count
    _ws_int8_fwd_kernel[(min(total, sms) if persistent else total,)](
        q_desc, k_desc, v_desc, qx.q_scale.contiguous(), qx.q_shift.contiguous(), x.k_scale,
        x.v_scale.reshape(-1).contiguous(), out, lse, kv_count, kv_index, *out.stride(),
        *bf16._table_strides(kv_count, kv_index, b, h), h, n, m, x.k_scale.shape[2], row_groups, total,
        scale * LOG2E, HEAD_DIM=d, BLOCK_M=block_q, BLOCK_N=block_k, NUM_STAGES=stages,
        CONSUMER_REGS=consumer_regs, PRODUCER_REGS=producer_regs, num_warps=4, maxnreg=MAXNREG)
    return out, lse
