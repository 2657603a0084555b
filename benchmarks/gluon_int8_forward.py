"""The int8 forward with its tensor-core work overlapped by hand, in Gluon (Triton's explicit-layout dialect):
a measured alternative to the library's Triton forward (``sparsevid.ops.triton_int8_attention``), on the same
quantized inputs with the same arithmetic (its outputs matched the library's bit for bit on the GPU), timed by
``benchmarks/int8_kernel_limits.py``. It lost: 0.640 ms against the Triton forward's 0.585 ms at the Wan 1.3B
shape at 95% (H100; benchmarks/NOTES.md).

Why it was built: in Triton every ``tl.dot`` of the loop is waited for where its result is first used, and the
P V promotion into the fp32 accumulator makes ptxas serialise every wgmma of the kernel. Here each product is
issued asynchronously and waited for explicitly, one warp group per 64 query rows:

    iteration j: issue P_{j-1} V_{j-1} (fp8, from zero) and S_j = Q K_j^T (int8);
                 wait for P_{j-1} V_{j-1}; acc = acc * rescale_{j-1} + P_{j-1} V_{j-1}   (S_j still running)
                 wait for S_j; online softmax of S_j -> P_j, rescale_j; issue the TMA loads of tile j + STAGES - 1

so nothing is serialised (ptxas -v) and the accumulator's update runs beside Q K^T. P V is computed from zero
per tile and added by the FMA that rescales the accumulator. The key-block index of each tile and its K and V
scales are loaded an iteration before their use, K and V tiles STAGES - 1 tiles ahead by TMA into a ring of
shared-memory slots with one mbarrier each (STAGES 2 or 3).

Layout needs (:func:`supported`): a Hopper GPU (sm_90), q8 and k8 contiguous [B, H, T, D] and v8 as
``quantize`` makes it (a [B, H, D, M'] buffer, tokens contiguous), a head dim of 64 or 128, 64-key mask blocks
and query blocks of a multiple of 64 rows. Descriptors are 2-D over the flattened heads: a key tile past M
reads the next head's first keys (finite int8, masked to -inf like the sequence's own tail), V's columns past M
are zero-filled by the copy engine.
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

try:  # Gluon and its Hopper ops ship with Triton >= 3.5
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                 warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton: no Gluon rows in the benchmark
    gluon = None

ROWS = 64  # query rows per program: one warp group
WARPS = 4
BLOCK_K = 64  # keys per tile
HEAD_DIMS = (64, 128)

if gluon is not None:
    _LOG2_P_SCALE = gl.constexpr(math.log2(P_SCALE))  # the library's: P in [0, 1] on the top of e4m3's range
    _LN2 = gl.constexpr(math.log(2.0))
    # Triton >= 3.7 names the TMA load async_load (async_copy_global_to_shared before)
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared

    @gluon.jit
    def _issue_tile(t, blk, count, k_desc, v_desc, k_smem, v_smem, bars, kv_row0, vd_row0,
                    BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr):
        """TMA loads of kept tile t (key block blk) into slot t % NUM_STAGES, signalled on that slot's barrier;
        nothing when t >= count."""
        pred = t < count
        slot = t % NUM_STAGES
        bar = bars.index(slot)
        mbarrier.expect(bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes, pred=pred)
        _tma_load(k_desc, [kv_row0 + blk * BLOCK_N, 0], bar, k_smem.index(slot), pred=pred)
        _tma_load(v_desc, [vd_row0, blk * BLOCK_N], bar, v_smem.index(slot), pred=pred)

    @gluon.jit
    def _gluon_int8_fwd_kernel(q_desc, k_desc, v_desc, QScale, QShift, KScale, VScale, Out, Lse, KvCount, KvIndex,
                               stride_ob, stride_oh, stride_on, stride_od,
                               stride_cb, stride_ch, stride_ib, stride_ih, stride_ir,
                               H, N, M, NUM_KV_BLOCKS, scale_log2,
                               HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                               ROWS: gl.constexpr, NUM_STAGES: gl.constexpr):
        """Program (pid_m, b*H + h): ROWS query rows of q8 (descriptor over [B*H*N, D]) against the kept key
        blocks of their query block: k8 by descriptor over [B*H*M, D], v8 over [B*H*D, M] (tokens contiguous).
        Writes Out [B, H, N, D] (any strides) and Lse float32 [B, H, N] (natural log)."""
        NUM_WARPS: gl.constexpr = gl.num_warps()
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                           instr_shape=[16, BLOCK_N, 32])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                           instr_shape=[16, HEAD_DIM, 32])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4)
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

        pid_m = gl.program_id(0)
        pid_bh = gl.program_id(1)
        i_b = pid_bh // H
        i_h = pid_bh % H
        q_block = (pid_m * ROWS) // BLOCK_M
        row0 = pid_m * ROWS

        q_smem = gl.allocate_shared_memory(q_desc.dtype, q_desc.block_type.shape, q_desc.layout)
        k_smem = gl.allocate_shared_memory(k_desc.dtype, [NUM_STAGES] + k_desc.block_type.shape, k_desc.layout)
        v_smem = gl.allocate_shared_memory(v_desc.dtype, [NUM_STAGES] + v_desc.block_type.shape, v_desc.layout)
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        bars = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)
        for i in gl.static_range(NUM_STAGES):
            mbarrier.init(bars.index(i), count=1)
        fence_async_shared()

        count = gl.load(KvCount + i_b * stride_cb + i_h * stride_ch + q_block)
        p_index = KvIndex + i_b * stride_ib + i_h * stride_ih + q_block * stride_ir
        last = gl.maximum(count - 1, 0)
        kv_row0 = pid_bh * M
        vd_row0 = pid_bh * HEAD_DIM
        mbarrier.expect(q_bar, q_desc.block_type.nbytes)
        _tma_load(q_desc, [pid_bh * N + row0, 0], q_bar, q_smem)
        for t in gl.static_range(NUM_STAGES - 1):
            _issue_tile(t, gl.load(p_index + gl.minimum(t, last)), count, k_desc, v_desc, k_smem, v_smem, bars,
                        kv_row0, vd_row0, BLOCK_N, NUM_STAGES)
        # key blocks of tiles j (blk_0) and j + 1 (blk_1), the tile about to be issued (blk_ahead, tile
        # j + NUM_STAGES - 1) and tile j's scales, each loaded an iteration before its use
        blk_0 = gl.load(p_index)
        blk_1 = gl.load(p_index + gl.minimum(1, last))
        blk_ahead = gl.load(p_index + gl.minimum(NUM_STAGES - 1, last))
        p_kscale = KScale + pid_bh.to(gl.int64) * NUM_KV_BLOCKS
        p_vscale = VScale + pid_bh.to(gl.int64) * NUM_KV_BLOCKS
        k_scale = gl.load(p_kscale + blk_0)
        v_scale = gl.load(p_vscale + blk_0)

        o_m = row0 + gl.arange(0, ROWS, layout=row_s)
        p_rows = pid_bh.to(gl.int64) * N + o_m
        b_rs = gl.load(QScale + p_rows, mask=o_m < N, other=1.0) * scale_log2
        o_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        s_zero = gl.zeros([ROWS, BLOCK_N], gl.int32, s_layout)
        o_zero = gl.zeros([ROWS, HEAD_DIM], gl.float32, o_layout)
        b_m = gl.full([ROWS], float("-inf"), gl.float32, row_s)
        b_l = gl.zeros([ROWS], gl.float32, row_s)
        b_acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, o_layout)
        # P of the tile before (zeros before the first: its product with tile 0's V adds nothing)
        b_p = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
        b_rescale = gl.zeros([ROWS], gl.float32, row_o)
        v_unit = gl.full([], 1.0, gl.float32)  # b_acc's unit: the V scale of the last tile added
        mbarrier.wait(q_bar, 0)

        for j in range(count):
            slot = j % NUM_STAGES
            mbarrier.wait(bars.index(slot), (j // NUM_STAGES) & 1)
            v_prev = v_smem.index(gl.maximum(j - 1, 0) % NUM_STAGES).permute((1, 0))
            o_tok = warpgroup_mma(gl.convert_layout(b_p.to(gl.float8e4nv), p_layout), v_prev, o_zero,
                                  use_acc=False, is_async=True)
            s_tok = warpgroup_mma(q_smem, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            b_o = warpgroup_mma_wait(1, deps=[o_tok])
            b_acc = gl.fma(b_acc, b_rescale[:, None], b_o)
            b_s, b_acc = warpgroup_mma_wait(0, deps=[s_tok, b_acc])

            # int32 logits to floats: exact, |logit| <= 127^2 * D < 2^24
            b_f = b_s.to(gl.float32)
            if (blk_0 + 1) * BLOCK_N > M:  # the sequence's short last block
                b_f = gl.where((blk_0 * BLOCK_N + o_n < M)[None, :], b_f, float("-inf"))
            b_tile_rs = b_rs * k_scale
            b_m_new = gl.maximum(b_m, gl.max(b_f, 1) * b_tile_rs - _LOG2_P_SCALE)
            b_p = gl.exp2(gl.fma(b_f, b_tile_rs[:, None], -b_m_new[:, None]))
            b_alpha = gl.exp2(b_m - b_m_new)
            b_l = b_l * b_alpha + gl.sum(b_p, 1)
            b_m = b_m_new
            # the accumulator moves to this tile's unit when its product is added (a power-of-two ratio: exact)
            b_rescale = gl.convert_layout(b_alpha * (v_unit / v_scale), row_o)
            v_unit = v_scale

            k_scale = gl.load(p_kscale + blk_1)
            v_scale = gl.load(p_vscale + blk_1)
            blk_next = gl.load(p_index + gl.minimum(j + NUM_STAGES, last))
            _issue_tile(j + NUM_STAGES - 1, blk_ahead, count, k_desc, v_desc, k_smem, v_smem, bars, kv_row0,
                        vd_row0, BLOCK_N, NUM_STAGES)
            blk_0 = blk_1
            if NUM_STAGES == 2:
                blk_1 = blk_next
            else:
                blk_1 = blk_ahead
            blk_ahead = blk_next

        if count > 0:  # the last tile's product
            v_last = v_smem.index((count - 1) % NUM_STAGES).permute((1, 0))
            o_tok = warpgroup_mma(gl.convert_layout(b_p.to(gl.float8e4nv), p_layout), v_last, o_zero,
                                  use_acc=False, is_async=True)
            b_acc = gl.fma(b_acc, b_rescale[:, None], warpgroup_mma_wait(0, deps=[o_tok]))
        mbarrier.invalidate(q_bar)
        for i in gl.static_range(NUM_STAGES):
            mbarrier.invalidate(bars.index(i))

        # epilogue (as the Triton forward's): rows without keys give zeros and lse -inf
        b_shift = gl.load(QShift + p_rows, mask=o_m < N, other=0.0) * scale_log2
        has_keys = b_l != 0.0
        b_l = gl.where(has_keys, b_l, 1.0)
        gl.store(Lse + p_rows, gl.where(has_keys, (b_m + gl.log2(b_l) + b_shift) * _LN2, float("-inf")),
                 mask=o_m < N)
        o_mo = row0 + gl.arange(0, ROWS, layout=row_o)
        o_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
        b_out = b_acc * (v_unit / gl.convert_layout(b_l, row_o))[:, None]
        p_o = (Out + i_b.to(gl.int64) * stride_ob + i_h.to(gl.int64) * stride_oh
               + o_mo[:, None].to(gl.int64) * stride_on + o_d[None, :] * stride_od)
        gl.store(p_o, b_out.to(Out.dtype.element_ty), mask=(o_mo < N)[:, None])


def supported(qx: Int8Queries, x: Int8Inputs, block_q: int, block_k: int) -> bool:
    """Whether :func:`gluon_int8_forward` takes these inputs (see the module's docstring)."""
    q8, k8, v8 = qx.q8, x.k8, x.v8
    if gluon is None or INTERPRET or not q8.is_cuda or torch.cuda.get_device_capability(q8.device)[0] != 9:
        return False
    return (q8.shape[-1] in HEAD_DIMS and block_k == BLOCK_K and block_q % ROWS == 0 and q8.is_contiguous()
            and k8.is_contiguous() and x.k_scale.is_contiguous() and x.v_scale.is_contiguous()
            and v_buffer_rows(v8) is not None)


def v_buffer_rows(v8: torch.Tensor) -> torch.Tensor | None:
    """v8 [B, H, M, D] (a view of a [B, H, D, M'] buffer, tokens contiguous) as the 2-D [B*H*D, M] view the
    kernel's descriptor covers, or None when the buffer's rows are not evenly strided so (e.g. a slice)."""
    b, h, m, d = v8.shape
    m_pad = v8.stride(3)
    if v8.stride(2) != 1 or v8.stride(1) != d * m_pad or (b > 1 and v8.stride(0) != h * d * m_pad):
        return None
    if (m_pad * v8.element_size()) % 16 or v8.data_ptr() % 16:
        return None
    return torch.as_strided(v8, (b * h * d, m), (m_pad, 1))


def gluon_int8_forward(qx: Int8Queries, x: Int8Inputs, kv_count: torch.Tensor, kv_index: torch.Tensor,
                       block_q: int, block_k: int, scale: float, like: torch.Tensor, stages: int = 3
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """``int8_forward`` on inputs :func:`supported` accepts, with ``stages`` K/V tiles in flight (2 or 3): out
    [B, H, N, D] (like's dtype and layout) and lse float32 [B, H, N] (natural log)."""
    if stages not in (2, 3):
        raise ValueError(f"stages must be 2 or 3, got {stages}")
    b, h, n, d = qx.q8.shape
    m = x.k8.shape[2]
    out = bf16._alloc(like)
    lse = bf16._alloc(like, (b, h, n), torch.float32)

    def descriptor(t: torch.Tensor, box: list[int], dtype) -> TensorDescriptor:
        layout = gl.NVMMASharedLayout.get_default_for(box, dtype)
        return TensorDescriptor(t, list(t.shape), list(t.stride()), box, layout)

    q_desc = descriptor(qx.q8.view(b * h * n, d), [ROWS, d], gl.int8)
    k_desc = descriptor(x.k8.view(b * h * m, d), [block_k, d], gl.int8)
    v_desc = descriptor(v_buffer_rows(x.v8), [d, block_k], gl.float8e4nv)
    _gluon_int8_fwd_kernel[(triton.cdiv(n, ROWS), b * h)](
        q_desc, k_desc, v_desc, qx.q_scale.contiguous(), qx.q_shift.contiguous(), x.k_scale, x.v_scale, out, lse,
        kv_count, kv_index, *out.stride(), *bf16._table_strides(kv_count, kv_index, b, h),
        h, n, m, x.k_scale.shape[2], scale * LOG2E,
        HEAD_DIM=d, BLOCK_M=block_q, BLOCK_N=block_k, ROWS=ROWS, NUM_STAGES=stages, num_warps=WARPS)
    return out, lse
