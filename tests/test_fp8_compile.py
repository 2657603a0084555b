"""The quantized kernels compile for a Hopper GPU (sm_90) on any machine, and their products are the tensor-core
instructions meant (wgmma): e4m3 x e4m3 -> f32 for precision="fp8"; s8 x s8 -> s32 (Q K^T) and e4m3 x e4m3 -> f32
(P V) for precision="int8". The interpreter (the CPU tests) runs the Python body and accepts what the GPU compiler
may reject, so each variant is compiled for the real target in a subprocess with the interpreter off: every
autotuning config of the fp8 forward for a 128x64 mask, with and without tensor descriptors, every config of the
int8 Triton forward (the first both ways), the quantizers' launches, and the Gluon int8 forwards, pipelined by hand
and warp-specialised (head dims 64 and 128, where this Triton has Gluon); ptxas must keep the fp8 and Gluon
forwards' MMAs pipelined, the first Gluon forward within its registers (no spills) and the warp-specialised one's
loop free of spills, and the int8 forward's MMAs pipelined in its 64-row configs (the ones measured fastest; with
128 rows ptxas serialises them for want of registers).
"""
from __future__ import annotations

import inspect
import os
import subprocess
import sys

QUANT_KERNELS = (("triton_fp8_attention", "_fp8_stats_kernel"), ("triton_fp8_attention", "_fp8_quant_kernel"),
                 ("triton_int8_attention", "_int8_stats_kernel"), ("triton_int8_attention", "_int8_quant_kernel"))
QUANT_TYPES = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "Q8": "*fp8e4nv", "Q8Lo": "*fp8e4nv", "K8": "*fp8e4nv",
               "V8": "*fp8e4nv", "Counter": "*i32"}
INT8_QUANT_TYPES = {**QUANT_TYPES, "Q8": "*i8", "K8": "*i8", "SAMPLES": "i32"}
# The int8 forward reads Q and K as int8.
INT8_TYPES = {"Q8": "*i8", "K": "*i8"}


def _type(name: str, constexprs: dict, sub: int, use_tma: bool, out: str, types: dict) -> str:
    """The argument types of the quantized kernels: K and V as descriptors with ``use_tma``, then ``types`` (the
    quantizers', the int8 forward's), else fp8 Q/K/V (V as a [B, H, D, M] descriptor), ``out`` for Out, fp32 scales and statistics, int32 tables and sizes."""
    if name in ("K", "V") and use_tma:
        box = [1, 1, sub, 128] if name == "K" else [1, 1, 128, sub]
        element = types.get(name, "*fp8e4nv")[1:]
        return f"tensordesc<{element}{box}>"
    if name in types:
        return types[name]
    if name == "Out":
        return out
    if name in constexprs:
        return "constexpr"
    types = {"Q": "*fp8e4nv", "QLo": "*fp8e4nv", "K": "*fp8e4nv", "V": "*fp8e4nv", "KvCount": "*i32", "KvIndex": "*i32",
             "scale_log2": "fp32"}
    if name in types:
        return types[name]
    sizes = ("H", "N", "M", "PARTS")
    return "*fp32" if name[0].isupper() and name not in sizes and not name.startswith("NUM") else "i32"


def _sass_loop():
    """scripts/sass_loop.py (a script, not a package module): ptxas's report and what it says."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("sass_loop", Path(__file__).parents[1] / "scripts" / "sass_loop.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def wgmma_serialized(ptx: str) -> bool:
    sass_loop = _sass_loop()
    return sass_loop.serialized(sass_loop.ptxas_report(ptx))


def _gluon_forward(kernel, constexprs: dict, d: int, q_rows: int, k_rows: int, options: dict):
    """A Gluon int8 forward compiled for sm_90a: q8 and k8 by int8 descriptors (boxes of q_rows and k_rows x d),
    v8 by an e4m3 one (d x k_rows), bf16 Out, fp32 scales and lse, int32 tables and sizes."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    def descriptor(dtype: str, box: list[int], gl_dtype) -> str:
        return f"tensordesc<{dtype}{box},{gl.NVMMASharedLayout.get_default_for(box, gl_dtype)!r}>"
    types = {"q_desc": descriptor("i8", [q_rows, d], gl.int8), "k_desc": descriptor("i8", [k_rows, d], gl.int8),
             "v_desc": descriptor("fp8e4nv", [d, k_rows], gl.float8e4nv), "Out": "*bf16", "KvCount": "*i32",
             "KvIndex": "*i32", "scale_log2": "fp32", "QScale": "*fp32", "QShift": "*fp32", "KScale": "*fp32",
             "VScale": "*fp32", "Lse": "*fp32"}
    names = inspect.signature(kernel.fn).parameters
    signature = {name: "constexpr" if name in constexprs else types.get(name, "i32") for name in names}
    return triton.compile(GluonASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                          target=GPUTarget("cuda", 90, 32), options=options)


def _int8_products(ptx: str) -> str:
    """Whether a PTX's tensor-core products are the int8 forward's: s8 x s8 (Q K^T) and e4m3 x e4m3 (P V) wgmma."""
    wanted = "wgmma.mma_async" in ptx and ".s32.s8.s8" in ptx and "f32.e4m3.e4m3" in ptx
    return "s8-and-e4m3-wgmma" if wanted else "missing-wgmma"


def compile_gluon_int8() -> None:
    """The Gluon int8 forward (`benchmarks/gluon_int8_forward.py`, a measured alternative) at 3 stages, head dims 64
    and 128: one line each with ptxas's verdict and its spill stores."""
    from benchmarks import gluon_int8_forward as g
    if g.gluon is None:
        print("gluon unavailable")
        return
    sass_loop = _sass_loop()
    for d in g.HEAD_DIMS:
        constexprs = {"HEAD_DIM": d, "BLOCK_M": 128, "BLOCK_N": g.BLOCK_K, "ROWS": g.ROWS, "NUM_STAGES": 3}
        kernel = _gluon_forward(g._gluon_int8_fwd_kernel, constexprs, d, g.ROWS, g.BLOCK_K, {"num_warps": g.WARPS})
        report = sass_loop.ptxas_report(kernel.asm["ptx"])
        print("compiled gluon int8 fwd", d, "serialized" if sass_loop.serialized(report) else "pipelined",
              _int8_products(kernel.asm["ptx"]), f"spills={sass_loop.spill_bytes(report)}")


def compile_gluon_ws_int8() -> None:
    """The warp-specialised Gluon int8 forward (`benchmarks/gluon_int8_ws_forward.py`, a measured alternative) at 3
    stages, head dims 64 and 128, 64-key blocks: one line each with ptxas's verdict and the spill instructions in
    the consumers' loop (ptxas spills a few registers outside it, where the partitions start)."""
    from benchmarks import gluon_int8_ws_forward as ws
    if ws.gluon is None:
        print("gluon unavailable")
        return
    sass_loop = _sass_loop()
    for d in ws.HEAD_DIMS:
        constexprs = {"HEAD_DIM": d, "BLOCK_M": 128, "BLOCK_N": 64, "NUM_STAGES": 3, "CONSUMER_REGS": 240,
                      "PRODUCER_REGS": 24}
        kernel = _gluon_forward(ws._ws_int8_fwd_kernel, constexprs, d, ws.HALF_ROWS, ws.SUB,
                                {"num_warps": 4, "maxnreg": ws.MAXNREG})
        analysis = sass_loop.analyse(kernel)
        loop_spills = analysis["loop"].get("STL", 0) + analysis["loop"].get("LDL", 0)
        print("compiled gluon ws int8 fwd", d, "serialized" if analysis["serialized"] else "pipelined",
              _int8_products(kernel.asm["ptx"]), f"loop-spills={loop_spills}")


def compile_all() -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from sparsevid.ops import triton_fp8_attention as t8
    from sparsevid.ops import triton_int8_attention as t_int8

    def build(fn, constexprs, out, sub=0, use_tma=False, num_warps=4, num_stages=2, types=()):
        names = inspect.signature(fn.fn).parameters
        signature = {name: _type(name, constexprs, sub, use_tma, out, dict(types)) for name in names}
        return triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps,
                                                                         "num_stages": num_stages})

    for module, name in QUANT_KERNELS:
        fn = getattr(t8 if module == t8.__name__.rsplit(".", 1)[1] else t_int8, name)
        sizes = {"HEAD_DIM": 128, "BLOCK_D": 128, "TILE": 64, "CHUNK": 256 if module == "triton_fp8_attention" else 64,
                 "PART_BLOCK": 32, "BLOCK_Q": 128, "BLOCK_K": 64, "NUM_CHUNKS": 4, "PART": 1024}
        constexprs = {c: v for c, v in sizes.items() if c in inspect.signature(fn.fn).parameters}
        types = QUANT_TYPES if module == "triton_fp8_attention" else INT8_QUANT_TYPES
        # the int8 quantizer writes V by pointers or (V_TMA) through a descriptor over [B, H, D, M]
        for v_tma in ((False, True) if name == "_int8_quant_kernel" else (None,)):
            if v_tma is not None:
                constexprs.update(Q_ROWS=64, V_TMA=v_tma)
                types = {**types, "V8": "tensordesc<fp8e4nv[1, 1, 128, 64]>" if v_tma else "*fp8e4nv"}
            build(fn, constexprs, "", num_warps=8, types=types)
        print("compiled quant", name)
    fwd = t_int8._bsa_int8_fwd_kernel
    for i, config in enumerate(fwd.configs):
        if config.kwargs["SUB_N"] > 64:
            continue  # pruned for 64-key blocks
        for use_tma in (False, True) if i == 0 else (True,):
            constexprs = {"HEAD_DIM": 128, "BLOCK_D": 128, "BLOCK_M": 128, "BLOCK_N": 64, "USE_TMA": use_tma,
                          **config.kwargs}
            kernel = build(fwd.fn, constexprs, "*bf16", config.kwargs["SUB_N"], use_tma, config.num_warps,
                           config.num_stages, types=INT8_TYPES)
            ptx = kernel.asm["ptx"]
            print("compiled int8 fwd", config.kwargs, config.num_warps, config.num_stages, config.maxnreg, use_tma,
                  "serialized" if wgmma_serialized(ptx) else "pipelined", _int8_products(ptx))
    fwd = t8._bsa_fp8_fwd_kernel
    for config in fwd.configs:
        if config.kwargs["SUB_N"] > 64:
            continue  # pruned for 64-key blocks
        for use_tma in (False, True):
            constexprs = {"HEAD_DIM": 128, "BLOCK_D": 128, "BLOCK_M": 128, "BLOCK_N": 64, "USE_TMA": use_tma,
                          **config.kwargs}
            kernel = build(fwd.fn, constexprs, "*bf16", config.kwargs["SUB_N"], use_tma, config.num_warps,
                           config.num_stages)
            ptx = kernel.asm["ptx"]
            print("compiled fwd", config.kwargs, config.num_warps, config.num_stages, use_tma,
                  "serialized" if wgmma_serialized(ptx) else "pipelined",
                  "e4m3-wgmma" if "f32.e4m3.e4m3" in ptx and "wgmma.mma_async" in ptx else "no-e4m3-wgmma")


def test_fp8_kernels_compile_for_sm90_with_e4m3_wgmma():
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "SPARSEVID_AUTOTUNE")}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the benchmarks package's folder
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (root, env.get("PYTHONPATH"))))
    done = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("compiled quant") == len(QUANT_KERNELS), done.stdout  # one line per kernel
    forwards = [line for line in done.stdout.splitlines() if line.startswith("compiled fwd")]
    assert len(forwards) >= 8 and all(line.endswith("e4m3-wgmma") for line in forwards), done.stdout
    int8_forwards = [line for line in done.stdout.splitlines() if line.startswith("compiled int8 fwd")]
    assert len(int8_forwards) >= 5 and all(line.endswith("s8-and-e4m3-wgmma") for line in int8_forwards), done.stdout
    assert all("pipelined" in line for line in int8_forwards if "'ROWS': 64," in line), done.stdout
    # the fp8 forward's P V is added by the rescale's FMA: ptxas keeps its MMAs pipelined
    assert all("pipelined" in line for line in forwards), done.stdout
    # the Gluon int8 forward (where this Triton has Gluon): pipelined, s8 and e4m3 products, no spills
    if "gluon unavailable" not in done.stdout:
        gluon = [line for line in done.stdout.splitlines() if line.startswith("compiled gluon int8 fwd")]
        assert len(gluon) == 2, done.stdout
        assert all("pipelined s8-and-e4m3-wgmma spills=0" in line for line in gluon), done.stdout
        ws = [line for line in done.stdout.splitlines() if line.startswith("compiled gluon ws int8 fwd")]
        assert len(ws) == 2, done.stdout
        assert all("pipelined s8-and-e4m3-wgmma loop-spills=0" in line for line in ws), done.stdout


if __name__ == "__main__":
    compile_all()
    compile_gluon_int8()
    compile_gluon_ws_int8()
