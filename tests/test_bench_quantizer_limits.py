"""The quantizer diagnostic's variants under the interpreter: those that write the library's layout give the
library's K bit for bit (their V is checked against the PyTorch quantizer's per-key-block V on the GPU: the
interpreter casts to e4m3 otherwise in a few % of the elements), and the table names each variant."""
import pytest
import torch
import triton

from benchmarks import quantizer_limits
from sparsevid.ops import triton_int8_attention
from sparsevid.ops.triton_launch import INTERPRET


@pytest.mark.skipif(not INTERPRET, reason="the interpreted Triton kernels")
def test_variants_in_the_library_layout_match_the_library_bit_for_bit(monkeypatch):
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, rep=100: 0.25)
    generator = torch.Generator().manual_seed(0)
    # 150 keys: three blocks of 64, the last one short, the pair programs' second block missing in the last pair
    q, k, v = (torch.randn(1, 2, 150, 64, generator=generator).bfloat16() for _ in range(3))
    v[0, 1, :, 5] *= 30.0  # an outlier channel: V's per-block scale follows it
    library = quantizer_limits.per_block_v(triton_int8_attention.quantize(q, k, v, 64)[1], v, 64)
    rows = [quantizer_limits._variant(k, v, library, *variant) for variant in quantizer_limits.VARIANTS]
    compared = [row for row in rows if "same_as_library" in row]
    # every variant over both tensors at 64 keys in the library's V layout is compared: those that divide as the
    # library does match it; a reciprocal may round an element the other way at a tie (within one int8 step)
    assert len(compared) == 13
    assert all(row["same_as_library"] for row in compared if not row["reciprocal"])
    assert all(row["k8_max_diff"] <= 1 for row in compared)
    assert all("same_as_library" not in row for row in rows if row["v_store"] == "[M, D]" or row["block_k"] != 64)
    table = quantizer_limits.markdown({"quantize_ms": 0.39, "copy_ms": 0.14, "rows": rows})
    assert "quantize (public call: Q, K and V): 0.390 ms; bf16 copy of K and V: 0.140 ms" in table
    assert "| 128 | 8 | V | tokens contiguous |  | 0.250 |  |  |" in table
    assert "| 64 | 4 | K and V | tokens contiguous |  | 0.250 | yes |" in table
    assert "| 64 | 8 | K and V | tokens contiguous (TMA store) |  | 0.250 | yes |" in table
    assert "| 64 | 8 | K and V, 2 blocks | tokens contiguous (TMA store) |  | 0.250 | yes |" in table
