"""The block-sparse forwards at the Wan 1.3B 480p shape (H=12, N=M=32,760, D=128, Gaussian inputs, a 128x64 top-k
mask at 95% sparsity) launched once each inside a CUDA profiler range, for Nsight Compute: the bf16 kernel, the
int8 kernel on quantized inputs and the int8 quantizer, and with ``--warp-specialized`` the int8 forward
warp-specialised in Gluon (``benchmarks/gluon_int8_ws_forward.py``). Every launch is autotuned and warmed up before
the range.

    ncu --profile-from-start off --set full --import-source no -o forwards python scripts/profile_forward.py
    ncu --import forwards.ncu-rep --page details        # stall reasons, issue rates, occupancy per kernel
"""
from __future__ import annotations

import argparse

import torch

import sparsevid as sv
from sparsevid.ops import triton_int8_attention


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sparsity", type=float, default=0.95)
    parser.add_argument("--tokens", type=int, default=32760)
    parser.add_argument("--warp-specialized", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("profile_forward.py needs a CUDA GPU")
    generator = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, 12, args.tokens, 128, device="cuda", dtype=torch.bfloat16, generator=generator)
               for _ in range(3))
    mask, _ = sv.predict_mask(q, k, rule="topk", topk=1.0 - args.sparsity, block_q=128, block_k=64)
    launches = {
        "bf16 forward": lambda: sv.block_sparse_attention(q, k, v, mask),
        "int8 quantizer": lambda: triton_int8_attention.quantize(q, k, v, 64),
    }
    qi, xi = triton_int8_attention.quantize(q, k, v, 64)
    launches["int8 forward"] = lambda: triton_int8_attention.int8_forward(
        qi, xi, mask.kv_count, mask.kv_index, 128, 64, 128 ** -0.5, q)
    if args.warp_specialized:
        from benchmarks import gluon_int8_ws_forward

        launches["int8 forward, warp-specialised"] = lambda: gluon_int8_ws_forward.ws_int8_forward(
            qi, xi, mask.kv_count, mask.kv_index, 128, 64, 128 ** -0.5, q)
    for launch in launches.values():  # autotune and warm up outside the profiled range
        for _ in range(3):
            launch()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for name, launch in launches.items():
        torch.cuda.nvtx.range_push(name)
        launch()
        torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print(f"profiled {list(launches)} at {args.tokens} tokens, sparsity {mask.sparsity:.3f}")


if __name__ == "__main__":
    main()
