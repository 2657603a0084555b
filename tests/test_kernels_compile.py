"""Every attention and mask-prediction kernel variant compiles for a Hopper GPU (sm_90), on any machine.

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
            "Delta": "*fp32", "dLse": "*fp32", "TileLse": "*fp32", "TileMass": "*fp32",
            # mask prediction
            "PooledQ": "*fp32", "PooledK": "*fp32", "SimQ": "*fp32", "SimK": "*fp32", "Logits": "*fp32",
            "Keep": "*i8", "Count": "*i32", "Index": "*i32", "KeptMass": "*fp32", "TopkPerHead": "*i32",
            "ToppPerHead": "*fp32", "SimPerHead": "*fp32", "Within": "*i8"}
FLOATS = {"scale", "scale_log2", "eps", "topp", "sim_threshold"}
SIZES = {"H", "N", "M", "NUM_Q_BLOCKS", "NUM_KV_BLOCKS", "TILE_SLOTS"}
COMMON = {"HEAD_DIM": 128, "BLOCK_D": 128, "BLOCK_M": 128, "BLOCK_N": 64, "DOT_PRECISION": "tf32"}


def _variants(ta):
    """(kernel, constexprs, descriptor boxes) for the forward (plain, tile masses), dQ and dK/dV, each with
    and without TMA; the boxes map the arguments read through tensor descriptors to their box rows."""
    for use_tma in (False, True):
        for with_mass in (False, True):
            rows = COMMON["BLOCK_N"] if with_mass else 32
            yield (ta._bsa_fwd_kernel, {**COMMON, "ROWS": 64, "SUB_N": 32, "WITH_MASS": with_mass, "USE_TMA": use_tma},
                   {"K": rows, "V": rows} if use_tma else {})
        yield (ta._bsa_bwd_dq_kernel, {**COMMON, "ROWS": 64, "SUB_N": 32, "USE_TMA": use_tma},
               {"K": 32, "V": 32} if use_tma else {})
        yield (ta._bsa_bwd_dkdv_kernel, {**COMMON, "COLS": 64, "SUB_M": 32, "USE_TMA": use_tma},
               {"Q": 32, "dOut": 32} if use_tma else {})
    yield ta._bsa_bwd_delta_kernel, {"HEAD_DIM": 128, "BLOCK_D": 128, "BLOCK_M": 128, "HAS_DLSE": True}, {}


def _signature(fn, constexprs: dict, boxes: dict | None = None) -> dict:
    """Argument types by name: bf16 tensors for q/k/v-like pointers (tensor descriptors with [1, 1, rows, D]
    boxes for the arguments in ``boxes``), int32 tables, fp32 statistics."""
    signature = {}
    for name in inspect.signature(fn.fn).parameters:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in (boxes or {}):
            signature[name] = f"tensordesc<bf16[1, 1, {boxes[name]}, {constexprs['HEAD_DIM']}]>"
        elif name in POINTERS:
            signature[name] = POINTERS[name]
        elif name not in SIZES and (name[0].isupper() or name in ("dOut", "dQ", "dK", "dV")):
            signature[name] = "*bf16"
        else:
            signature[name] = "fp32" if name in FLOATS else "i32"
    return signature


def _predict_variants(tp):
    """(kernel, constexprs, num_warps, num_stages, no descriptor boxes) for each candidate config of the pool,
    logits and select kernels, with every option on (similarity check, per-head thresholds, restriction to an
    earlier mask)."""
    pool = {"HEAD_DIM": 128, "BLOCK_D": 128, "BLOCK_Q": 128, "BLOCK_K": 64, "WITH_SIM": True}
    logits = {"HEAD_DIM": 128, "BLOCK_D": 128, "BLOCK_KB": 2048, "DOT_PRECISION": "tf32x3"}
    select = {"HEAD_DIM": 128, "BLOCK_Q": 128, "BLOCK_K": 64, "WITH_SIM": True, "BLOCK_KB": 2048, "HEAD_KB": 1024,
              "TAIL_KB": 256, "USE_TOPK": True, "USE_TOPP": True, "TOPK_PER_HEAD": True,
              "TOPP_PER_HEAD": True, "SIM_PER_HEAD": True, "KEEP_SINK": True, "KEEP_DIAGONAL": True, "WITHIN": True}
    for kernel, configs, base in ((tp._pool_kernel, tp.POOL_CONFIGS, pool),
                                  (tp._logits_kernel, tp.LOGITS_CONFIGS, logits),
                                  (tp._select_kernel, tp.SELECT_CONFIGS, select)):
        for config in configs:
            constexprs = {**base, **config.kwargs}
            if kernel is tp._select_kernel:
                for name, rule in tp._SELECT_HEURISTICS.items():
                    constexprs[name] = rule(constexprs)
            yield kernel, constexprs, config.num_warps, config.num_stages, {}


def compile_all() -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from sparsevid.ops import triton_attention as ta
    from sparsevid.ops import triton_predict as tp

    variants = [(kernel, constexprs, 4, 2, boxes) for kernel, constexprs, boxes in _variants(ta)]
    for kernel, constexprs, num_warps, num_stages, boxes in variants + list(_predict_variants(tp)):
        fn = kernel
        while not isinstance(fn, triton.runtime.jit.JITFunction):
            fn = fn.fn
        source = ASTSource(fn=fn, signature=_signature(fn, constexprs, boxes), constexprs=constexprs)
        triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps,
                                                                                "num_stages": num_stages})
        print("compiled", fn.fn.__name__, num_warps,
              {k: v for k, v in constexprs.items() if k in ("WITH_MASS", "USE_TMA", "SEL_ROWS", "POOL_CHUNK")})


def test_every_kernel_variant_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    from sparsevid.ops import triton_predict as tp

    expected = 9 + len(tp.POOL_CONFIGS) + len(tp.LOGITS_CONFIGS) + len(tp.SELECT_CONFIGS)
    assert done.stdout.count("compiled") == expected, done.stdout


if __name__ == "__main__":
    compile_all()
