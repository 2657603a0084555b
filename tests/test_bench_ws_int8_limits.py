"""The warp-specialised int8 forward's benchmark off the GPU: the kernel declines inputs it cannot take (CPU tensors
here), and the report names every case, variant and timing."""
import torch

from benchmarks import gluon_int8_ws_forward as ws
from benchmarks import ws_int8_limits
from sparsevid.ops import triton_int8_attention


def test_it_declines_what_it_cannot_run():
    q, k, v = (torch.randn(1, 2, 256, 64) for _ in range(3))
    qx, x = triton_int8_attention.quantize(q, k, v, 64)
    assert not ws.supported(qx, x, 128, 64)


def test_report_names_each_case_and_timing():
    result = {"agreement": [{"case": "B1 H2 N777 M1500 D64 128x64 50%", "variant": [3, True, 240, 24],
                             "vs_library": 3.4e-4, "lse_max_diff": 9.5e-7, "vs_f64": 0.0377, "library_vs_f64": 0.0377,
                             "ok": True}],
              "timing": [{"shape": "wan1.3b", "mask": "95%", "cudnn_ms": 11.2, "library_ms": 0.587,
                          "ws_s3_persistent_240_24_ms": 0.604, "ws_s3_persistent_240_24_vs_library": 1e-3}]}
    table = ws_int8_limits.markdown(result)
    assert "| B1 H2 N777 M1500 D64 128x64 50% | [3, True, 240, 24] | 3.40e-04 | 9.5e-07 | 0.0377 (0.0377) | True |" in table
    assert "wan1.3b 95%: cuDNN 11.200 ms" in table
    assert "- library: 0.587 ms (19.1x)" in table and "- ws_s3_persistent_240_24: 0.604 ms (18.5x)" in table
