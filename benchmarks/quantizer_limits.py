"""What bounds the int8 K/V quantizer (the key-block programs of ``triton_int8_attention.quantize``): its kernel
taken apart.

At the Wan 1.3B shape (Q, K and V [1, 12, 32,760, 128] bf16, 64-key blocks) the public call (which quantizes Q
too), a bf16 copy of K and V
(400 MB moved: the memory floor's neighbourhood; the quantizer moves 300 MB) and variants of the K/V kernel, each
timed alone (``triton.testing.do_bench``):

* the library kernel's arithmetic with 4 or 8 warps, and with K scaled by a correctly rounded reciprocal instead of
  an exact division per element;
* K and V in programs of their own;
* two key blocks per program (each with its own scales, the library's outputs), V stored by pointers or by TMA;
* K's part alone, V's part alone: V written tokens-contiguous ([B, H, D, M'], what the attention kernel's FP8
  product needs) or as [B, H, M, D] (the wrong layout for the kernel: what the transposed store costs), with
  transposes done on float32 values or on bytes, or written by a TMA store of the transposed tile (Hopper or
  newer), and over key blocks of 64, 128 or 256.

A variant that writes the library's layout is checked bit for bit against the library's K outputs and against
V quantized per key block by the PyTorch quantizer (on the GPU; the library scales V per head since the two-tile
forward; the
library writes V by a TMA store where the GPU has one, by pointers elsewhere). Writes
``results/quantizer_limits/<gpu>.{json,md}``.

    python -m benchmarks quantizer_limits      # CUDA only
"""
from __future__ import annotations

import argparse
import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from sparsevid.ops import fp8_reference
from sparsevid.ops import triton_int8_attention as int8
from sparsevid.ops.triton_fp8_attention import _abs_or_zero, _pow2_scale, _tile_ptrs, _to_fp8
from .report import write_result
from .run_info import run_metadata

# V's store: tokens contiguous (the library's layout), the same after a transpose of the float32 tile or of its
# bytes, or through a tensor descriptor (a TMA store of the transposed tile), or [M, D] (timing only).
V_TRANSPOSED, V_TRANSPOSED_FLOATS, V_TRANSPOSED_BYTES, V_TMA, V_ROWS = 1, 2, 3, 4, 0
# What a variant quantizes: both tensors in one program, K only, V only, K and V in programs of their own
# (_kv_variant's PART), or both over two key blocks per program (_kv_pairs).
BOTH, K_ONLY, V_ONLY, APART, PAIRS = -1, 0, 1, 2, 3
PARTS = {BOTH: "K and V", K_ONLY: "K", V_ONLY: "V", APART: "K, V apart", PAIRS: "K and V, 2 blocks"}
V_STORES = {V_ROWS: "[M, D]", V_TRANSPOSED: "tokens contiguous",
            V_TRANSPOSED_FLOATS: "tokens contiguous (float transpose)",
            V_TRANSPOSED_BYTES: "tokens contiguous (byte transpose)", V_TMA: "tokens contiguous (TMA store)"}


@triton.jit
def _kv_variant(K, V, KMean, K8, V8, V8Desc, KScale, VScale, stride_kb, stride_kh, stride_kn, stride_kd,
                stride_vb, stride_vh, stride_vn, stride_vd, stride_k8b, stride_k8h, stride_k8n,
                stride_v8b, stride_v8h, stride_v8d, H, M,
                HEAD_DIM: tl.constexpr, BLOCK_K: tl.constexpr, RECIPROCAL: tl.constexpr, PART: tl.constexpr,
                V_STORE: tl.constexpr):
    """The library's ``_int8_kv_kernel`` (program (j, b*H + h[, part]), key block j) with switches: PART -1 both
    tensors, 0 K only, 1 V only, 2 K or V by program_id(2)."""
    blk = tl.program_id(0)
    pid_bh = tl.program_id(1)
    part = tl.program_id(2) if PART == 2 else PART
    i_b = (pid_bh // H).to(tl.int64)
    i_h = (pid_bh % H).to(tl.int64)
    start = blk * BLOCK_K
    p_scale = pid_bh.to(tl.int64) * tl.cdiv(M, BLOCK_K) + blk
    o_d = tl.arange(0, HEAD_DIM)
    if PART == -1 or part == 0:
        b_mean = tl.load(KMean + pid_bh * HEAD_DIM + o_d)
        p_k, m_tile = _tile_ptrs(K, i_b, i_h, stride_kb, stride_kh, stride_kn, stride_kd, start, M, BLOCK_K,
                                 HEAD_DIM, HEAD_DIM)
        b_k = tl.where(m_tile, tl.load(p_k, mask=m_tile, other=0.0).to(tl.float32) - b_mean[None, :], 0.0)
        amax = tl.max(tl.max(_abs_or_zero(b_k), 1), 0)
        k_scale = int8._int8_scale(amax, int8._all_finite(b_k, None))
        tl.store(KScale + p_scale, k_scale)
        p_k8, _ = _tile_ptrs(K8, i_b, i_h, stride_k8b, stride_k8h, stride_k8n, 1, start, M, BLOCK_K, HEAD_DIM,
                             HEAD_DIM)
        if RECIPROCAL:
            b_y = b_k * tl.math.div_rn(tl.zeros_like(amax) + int8._INT8_MAX, amax)
        else:
            b_y = tl.math.div_rn(b_k, tl.zeros_like(b_k) + k_scale)
        tl.store(p_k8, int8._round_int8(b_y), mask=m_tile)
    if PART == -1 or part == 1:
        p_v, m_tile = _tile_ptrs(V, i_b, i_h, stride_vb, stride_vh, stride_vn, stride_vd, start, M, BLOCK_K,
                                 HEAD_DIM, HEAD_DIM)
        b_v = tl.load(p_v, mask=m_tile, other=0.0).to(tl.float32)
        v_scale = _pow2_scale(tl.max(tl.max(_abs_or_zero(b_v), 1), 0))
        tl.store(VScale + p_scale, v_scale)
        b_v = b_v * tl.math.div_rn(1.0, v_scale)
        o_t = start + tl.arange(0, BLOCK_K)
        m_t = (o_t < M)[None, :]
        p_vt = V8 + i_b * stride_v8b + i_h * stride_v8h + o_d[:, None].to(tl.int64) * stride_v8d + o_t[None, :]
        if V_STORE == 1:
            p_v8, _ = _tile_ptrs(V8, i_b, i_h, stride_v8b, stride_v8h, 1, stride_v8d, start, M, BLOCK_K, HEAD_DIM,
                                 HEAD_DIM)
            tl.store(p_v8, _to_fp8(b_v), mask=m_tile)
        elif V_STORE == 2:
            tl.store(p_vt, _to_fp8(tl.trans(b_v)), mask=m_t)
        elif V_STORE == 3:
            tl.store(p_vt.to(tl.pointer_type(tl.uint8)), tl.trans(_to_fp8(b_v).to(tl.uint8, bitcast=True)), mask=m_t)
        elif V_STORE == 4:
            # the descriptor spans [B, H, D, M]: keys past M are not written
            V8Desc.store([i_b.to(tl.int32), i_h.to(tl.int32), 0, start],
                         tl.trans(_to_fp8(b_v)).reshape(1, 1, HEAD_DIM, BLOCK_K))
        else:
            p_v8, _ = _tile_ptrs(V8, i_b, i_h, stride_v8b, stride_v8h, HEAD_DIM, 1, start, M, BLOCK_K, HEAD_DIM,
                                 HEAD_DIM)
            tl.store(p_v8, _to_fp8(b_v), mask=m_tile)


@triton.jit
def _kv_pairs(K, V, KMean, K8, V8, V8Desc, KScale, VScale, stride_kb, stride_kh, stride_kn, stride_kd,
              stride_vb, stride_vh, stride_vn, stride_vd, stride_k8b, stride_k8h, stride_k8n,
              stride_v8b, stride_v8h, stride_v8d, H, M,
              HEAD_DIM: tl.constexpr, BLOCK_K: tl.constexpr, V_STORE: tl.constexpr):
    """The library's quantizer over two key blocks per program (program (j, b*H + h): blocks 2j and 2j + 1), each
    with its own scales as in the library: the same outputs from half the programs, V's rows written 2 * BLOCK_K
    keys at a time (tokens contiguous, by pointers or, V_STORE == 4, by a TMA store)."""
    pair = tl.program_id(0)
    pid_bh = tl.program_id(1)
    i_b = (pid_bh // H).to(tl.int64)
    i_h = (pid_bh % H).to(tl.int64)
    start = pair * 2 * BLOCK_K
    num_blocks = tl.cdiv(M, BLOCK_K)
    o_half = 2 * pair + tl.arange(0, 2)  # the two key blocks
    p_scale = pid_bh.to(tl.int64) * num_blocks + o_half
    m_half = o_half < num_blocks
    o_d = tl.arange(0, HEAD_DIM)
    b_mean = tl.load(KMean + pid_bh * HEAD_DIM + o_d)
    p_k, m_tile = _tile_ptrs(K, i_b, i_h, stride_kb, stride_kh, stride_kn, stride_kd, start, M, 2 * BLOCK_K,
                             HEAD_DIM, HEAD_DIM)
    b_k = tl.where(m_tile, tl.load(p_k, mask=m_tile, other=0.0).to(tl.float32) - b_mean[None, :], 0.0)
    b_k3 = b_k.reshape(2, BLOCK_K, HEAD_DIM)
    finite = tl.min(tl.min((tl.abs(b_k3) < float("inf")).to(tl.int32), 2), 1) > 0
    k_scale = int8._int8_scale(tl.max(tl.max(_abs_or_zero(b_k3), 2), 1), finite)  # [2]
    tl.store(KScale + p_scale, k_scale, mask=m_half)
    b_y = tl.math.div_rn(b_k3, tl.zeros_like(b_k3) + k_scale[:, None, None]).reshape(2 * BLOCK_K, HEAD_DIM)
    p_k8, _ = _tile_ptrs(K8, i_b, i_h, stride_k8b, stride_k8h, stride_k8n, 1, start, M, 2 * BLOCK_K, HEAD_DIM,
                         HEAD_DIM)
    tl.store(p_k8, int8._round_int8(b_y), mask=m_tile)
    p_v, _ = _tile_ptrs(V, i_b, i_h, stride_vb, stride_vh, stride_vn, stride_vd, start, M, 2 * BLOCK_K, HEAD_DIM,
                        HEAD_DIM)
    b_v3 = tl.load(p_v, mask=m_tile, other=0.0).to(tl.float32).reshape(2, BLOCK_K, HEAD_DIM)
    v_scale = _pow2_scale(tl.max(tl.max(_abs_or_zero(b_v3), 2), 1))  # [2]
    tl.store(VScale + p_scale, v_scale, mask=m_half)
    b_v8 = _to_fp8((b_v3 * tl.math.div_rn(tl.zeros_like(v_scale) + 1.0, v_scale)[:, None, None])
                   .reshape(2 * BLOCK_K, HEAD_DIM))
    if V_STORE == 4:
        V8Desc.store([i_b.to(tl.int32), i_h.to(tl.int32), 0, start],
                     tl.trans(b_v8).reshape(1, 1, HEAD_DIM, 2 * BLOCK_K))
    else:
        p_v8, _ = _tile_ptrs(V8, i_b, i_h, stride_v8b, stride_v8h, 1, stride_v8d, start, M, 2 * BLOCK_K, HEAD_DIM,
                             HEAD_DIM)
        tl.store(p_v8, b_v8, mask=m_tile)


def _variant(k, v, library: int8.Int8Inputs, block_k: int, warps: int, part: int = BOTH, v_store: int = V_TRANSPOSED,
             reciprocal: bool = False) -> dict:
    """Time one variant (part PAIRS: :func:`_kv_pairs`, two key blocks of block_k per program, else
    :func:`_kv_variant`); where it writes the library's layout at the library's block size, compare its outputs."""
    b, h, m, d = k.shape
    kb = triton.cdiv(m, block_k)
    k8, v8 = torch.empty_like(library.k8), torch.empty_strided(library.v8.shape, library.v8.stride(),
                                                               dtype=library.v8.dtype, device=k.device)
    k_scale, v_scale = (k.new_empty((b, h, kb), dtype=torch.float32) for _ in range(2))
    keys_per_store = 2 * block_k if part == PAIRS else block_k
    # [B, H, D, M], unit key stride
    v8_desc = TensorDescriptor.from_tensor(v8.transpose(-1, -2), [1, 1, d, keys_per_store])
    args = (k, v, library.k_mean, k8, v8, v8_desc, k_scale, v_scale, *k.stride(), *v.stride(), *k8.stride()[:3],
            v8.stride(0), v8.stride(1), v8.stride(3), h, m)

    def run():
        if part == PAIRS:
            _kv_pairs[(triton.cdiv(kb, 2), b * h)](*args, HEAD_DIM=d, BLOCK_K=block_k, V_STORE=v_store,
                                                   num_warps=warps)
        else:
            _kv_variant[(kb, b * h, 2 if part == APART else 1)](*args, HEAD_DIM=d, BLOCK_K=block_k,
                                                            RECIPROCAL=reciprocal, PART=part, V_STORE=v_store,
                                                            num_warps=warps)

    run()
    row = {"block_k": block_k, "warps": warps, "part": PARTS[part],
           "v_store": V_STORES[v_store] if part != K_ONLY else "",
           "reciprocal": reciprocal, "ms": triton.testing.do_bench(run, rep=100)}
    if part in (BOTH, APART, PAIRS) and v_store != V_ROWS and kb == library.k_scale.shape[-1]:
        row["k8_max_diff"] = int((k8.int() - library.k8.int()).abs().max())
        row["same_as_library"] = bool(torch.equal(k8, library.k8) and torch.equal(k_scale, library.k_scale))
        row["v_as_reference"] = bool(torch.equal(v_scale, library.v_scale)
                                     and torch.equal(v8.view(torch.uint8), library.v8.view(torch.uint8)))
    print(row, flush=True)
    return row


VARIANTS = (  # (block_k, warps, part, v_store, reciprocal)
    (64, 8, BOTH, V_TRANSPOSED, False), (64, 4, BOTH, V_TRANSPOSED, False), (64, 8, BOTH, V_TRANSPOSED, True),
    (64, 4, BOTH, V_TRANSPOSED, True), (64, 4, APART, V_TRANSPOSED, False), (64, 4, APART, V_TRANSPOSED, True),
    (64, 4, BOTH, V_TRANSPOSED_FLOATS, False), (64, 4, BOTH, V_TRANSPOSED_BYTES, False), (64, 4, BOTH, V_TMA, False),
    (64, 8, BOTH, V_TMA, False), (64, 4, BOTH, V_ROWS, False),
    (64, 4, K_ONLY, V_TRANSPOSED, False), (64, 4, V_ONLY, V_TRANSPOSED, False),
    (64, 4, V_ONLY, V_TRANSPOSED_FLOATS, False), (64, 4, V_ONLY, V_ROWS, False), (128, 4, V_ONLY, V_TRANSPOSED, False),
    (128, 8, V_ONLY, V_TRANSPOSED, False), (256, 8, V_ONLY, V_TRANSPOSED, False), (128, 8, V_ONLY, V_ROWS, False),
    (64, 4, V_ONLY, V_TMA, False), (128, 4, V_ONLY, V_TMA, False), (64, 4, PAIRS, V_TRANSPOSED, False),
    (64, 8, PAIRS, V_TRANSPOSED, False), (64, 8, PAIRS, V_TMA, False),
)


def per_block_v(x: int8.Int8Inputs, v: torch.Tensor, block_k: int) -> int8.Int8Inputs:
    """The library's quantized K with V quantized as the variants here do (one power-of-two scale per key block,
    the library's design until it moved to one scale per head), in the library's tokens-contiguous layout: what a
    variant's outputs are compared with."""
    v8, v_scale = fp8_reference.quantize_fp8_blocks(v.float(), block_k)
    laid_out = torch.empty_strided(x.v8.shape, x.v8.stride(), dtype=x.v8.dtype, device=v.device)
    laid_out.copy_(v8)
    return x._replace(v8=laid_out, v_scale=v_scale)


def markdown(result: dict) -> str:
    lines = [f"quantize (public call: Q, K and V): {result['quantize_ms']:.3f} ms; bf16 copy of K and V: "
             f"{result['copy_ms']:.3f} ms", "",
             "| keys per program | warps | part | V store | K by reciprocal | ms | K as library | V as per-block quantizer |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        same = {True: "yes", False: f"no (k8 within {r.get('k8_max_diff')})"}.get(r.get("same_as_library"), "")
        v_same = {True: "yes", False: "no"}.get(r.get("v_as_reference"), "")
        lines.append(f"| {r['block_k']} | {r['warps']} | {r['part']} | {r['v_store']} | "
                     f"{'yes' if r['reciprocal'] else ''} | {r['ms']:.3f} | {same} | {v_same} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("quantizer_limits needs a CUDA GPU", file=sys.stderr)
        return 2
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, 12, 32760, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    library = per_block_v(int8.quantize(q, k, v, 64)[1], v, 64)
    result = {"quantize_ms": triton.testing.do_bench(lambda: int8.quantize(q, k, v, 64), rep=100),
              "copy_ms": triton.testing.do_bench(lambda: (k.clone(), v.clone()), rep=100),
              "rows": [_variant(k, v, library, *variant) for variant in VARIANTS
                       if variant[3] != V_TMA or torch.cuda.get_device_capability(k.device)[0] >= 9]}
    write_result(args.out, run_metadata(k.device), result, markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
