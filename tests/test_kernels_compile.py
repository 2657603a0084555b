"""Every attention kernel variant compiles for a Hopper GPU (sm_90), on any machine.

The CPU tests run the kernels in Triton's interpreter, which executes the Python body and so accepts code
the GPU compiler rejects (e.g. a variable defined only inside a branch). This test compiles each variant for
the real target, without a GPU, in a subprocess (the kernels must be imported with the interpreter off).
"""
from __future__ import annotations

import inspect
import os
import subprocess
import sys

POINTERS = {"KvCount": "*i32", "KvIndex": "*i32", "QCount": "*i32", "QIndex": "*i32", "Lse": "*fp32",
            "Delta": "*fp32", "dLse": "*fp32", "TileLse": "*fp32", "TileMass": "*fp32"}
FLOATS = {"scale", "scale_log2"}
SIZES = {"H", "N", "M", "NUM_Q_BLOCKS", "NUM_KV_BLOCKS", "TILE_SLOTS"}
COMMON = {"HEAD_DIM": 128, "BLOCK_D": 128, "BLOCK_M": 128, "BLOCK_N": 64, "DOT_PRECISION": "tf32"}


def _variants(ta):
    """(kernel, constexprs) for the forward (plain, tile masses), dQ and dK/dV, each with and without TMA."""
    for use_tma in (False, True):
        for with_mass in (False, True):
            yield ta._bsa_fwd_kernel, {**COMMON, "ROWS": 64, "SUB_N": 32, "WITH_MASS": with_mass, "USE_TMA": use_tma}
        yield ta._bsa_bwd_dq_kernel, {**COMMON, "ROWS": 64, "SUB_N": 32, "USE_TMA": use_tma}
        yield ta._bsa_bwd_dkdv_kernel, {**COMMON, "COLS": 64, "SUB_M": 32, "USE_TMA": use_tma}
    yield ta._bsa_bwd_delta_kernel, {"HEAD_DIM": 128, "BLOCK_D": 128, "BLOCK_M": 128, "HAS_DLSE": True}


def _signature(fn, constexprs: dict) -> dict:
    """Argument types by name: bf16 tensors for q/k/v-like pointers, int32 tables, fp32 statistics."""
    signature = {}
    for name in inspect.signature(fn.fn).parameters:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in POINTERS:
            signature[name] = POINTERS[name]
        elif name not in SIZES and (name[0].isupper() or name in ("dOut", "dQ", "dK", "dV")):
            signature[name] = "*bf16"
        else:
            signature[name] = "fp32" if name in FLOATS else "i32"
    return signature


def compile_all() -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from sparsevid.ops import triton_attention as ta

    for kernel, constexprs in _variants(ta):
        fn = kernel
        while not isinstance(fn, triton.runtime.jit.JITFunction):
            fn = fn.fn
        source = ASTSource(fn=fn, signature=_signature(fn, constexprs), constexprs=constexprs)
        triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 2})
        print("compiled", fn.fn.__name__, {k: v for k, v in constexprs.items() if k in ("WITH_MASS", "USE_TMA")})


def test_every_kernel_variant_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("compiled") == 9, done.stdout


if __name__ == "__main__":
    compile_all()
