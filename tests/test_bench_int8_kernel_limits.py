"""The int8 forward diagnostic's kernel under the interpreter: its switches change how the loop computes, not what
(the interpreter computes every product exactly, so the promotions and the integer additions agree up to float32
rounding; the conversion instruction skips the library's cut of the logit scale to 22 bits, a relative change below 2^-21),
and the table names each variant."""
import pytest
import torch

import sparsevid as sv
from benchmarks import int8_kernel_limits as limits
from sparsevid.ops import triton_int8_attention
from sparsevid.ops.triton_launch import INTERPRET
from test_int8_attention import _fp8_eps


@pytest.mark.skipif(not INTERPRET, reason="the interpreted Triton kernels")
def test_switches_agree_under_the_interpreter(nan_poisoned_outputs):
    generator = torch.Generator().manual_seed(0)
    # 150 tokens: a short last key block (the ragged tail) and a short last query block
    q, k, v = (torch.randn(1, 2, 150, 64, generator=generator) for _ in range(3))
    keep = torch.rand(1, 2, 2, 3, generator=generator) < 0.6
    keep[..., 0] = True
    mask = sv.SparseMask.from_dense(keep, 150, 150, 128, 64)
    qx, x = triton_int8_attention.quantize(q, k, v, 64)
    blocks = limits.per_block_v_scale(x)  # the variants' design: V's scale per key block (here the head's, repeated)
    assert blocks.v_scale.shape == (1, 2, 3)
    launch, ref, ref_lse = limits.run_variant(q, qx, blocks, mask, 64, 4, 3)
    launch()
    emu, _ = sv.block_sparse_attention(q, k, v, mask, return_lse=True, backend="reference", precision="int8")
    # against the emulation, as the library's kernel is held (test_int8_attention.py): the interpreter's cast of P
    assert limits.rel_l1(ref, emu) <= 3.5 * _fp8_eps(v)
    for q_prologue, conv, promo in ((True, limits.BITS, limits.FMA), (False, limits.ASM_ADD, limits.FMA),
                                    (False, limits.BITS, limits.TRITON_PROMOTION),
                                    (False, limits.BITS, limits.NO_PROMOTION), (False, limits.CONVERT, limits.FMA)):
        launch, out, lse = limits.run_variant(q, qx, blocks, mask, 64, 4, 3, q_prologue, conv, promo)
        launch()
        if conv != limits.CONVERT:  # the exponents move by ~2^-21: a few of P's e4m3 roundings flip
            assert limits.rel_l1(out, ref) < 0.1 * _fp8_eps(v) and limits.rel_l1(lse, ref_lse) < 1e-6
        else:  # float32 roundings apart: the rescale with or without the FMA
            assert limits.rel_l1(out, ref) < 1e-6 and limits.rel_l1(lse, ref_lse) < 1e-6, (q_prologue, conv, promo)
    # the two-tile step accumulating over every step, or with a fresh product every 1 or 2 steps, against the
    # library's (a fresh product every step): float32 roundings apart
    library, library_lse = triton_int8_attention.int8_forward(qx, x, mask.kv_count, mask.kv_index, 128, 64,
                                                              64 ** -0.5, q)
    for fold in (0, 1, 2):
        launch, out, lse = limits.run_pairs(q, qx, x, mask, 64, 4, 3, fold)
        launch()
        assert limits.rel_l1(out, library) < 1e-6 and limits.rel_l1(lse, library_lse) < 1e-6, fold
    # V as two e4m3 terms: only P's rounding left, closer to the exact (float64) attention; the same row sums
    v_lo = limits.v_residual(v, x)
    assert v_lo.shape == (1, 2, 64, 150) and v_lo.stride() == x.v8.transpose(-1, -2).stride()
    exact = sv.block_sparse_attention(q.double(), k.double(), v.double(), mask, backend="reference")
    launch, two_term, two_term_lse = limits.run_pairs(q, qx, x, mask, 64, 4, 3, 0, v_lo)
    launch()
    assert limits.rel_l1(two_term_lse, library_lse) < 1e-6
    assert limits.rel_l1(two_term, exact) < 0.8 * limits.rel_l1(library, exact)


def test_table_names_each_variant():
    row = {"q": "read", "conv": limits.CONVERSIONS[limits.CONVERT], "promo": limits.PROMOTIONS[limits.TRITON_PROMOTION],
           "rows": 128, "warps": 4, "stages": 2, "ms": 0.5, "rel_l1": 0.0123}
    summary = {"bf16_ms": 0.69, "quantize_ms": 0.2, "library_ms": 0.5, "library_rel_l1": 0.0123,
               "library_full_ms": 8.9, "library_full_rel_l1": 0.0201}
    table = limits.markdown({**summary, "rows": [row, {**row, "mask": "full", "promo": "none"}]})
    assert "bf16 sparse kernel 0.690 ms; int8: quantize (Q, K and V) 0.200 ms" in table
    assert "full mask 8.900 ms, rel L1 vs bf16 0.0201" in table
    assert "| 95% | read | cvt (I2FP) | max_num_imprecise_acc | 128 | 4 | 2 | - | 0.500 | 0.0123 |  |" in table
    assert "| full | read | cvt (I2FP) | none | 128 | 4 | 2 | - | 0.500 | 0.0123 |  |" in table
    pairs = limits.markdown({**summary, "rows": [{**row, "promo": limits.pairs_label(4), "rel_l1_vs_library": 0.0012}]})
    assert ("| pairs of tiles, V per head, fresh product every 4 step(s) + FMA | 128 | 4 | 2 | - | 0.500 | 0.0123 "
            "| 0.0012 |") in pairs
    capped = limits.markdown({**summary, "rows": [{**row, "rows": 64, "maxnreg": 168}]})
    assert "| 95% | read | cvt (I2FP) | max_num_imprecise_acc | 64 | 4 | 2 | 168 | 0.500 | 0.0123 |  |" in capped
