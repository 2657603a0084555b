"""What the compiler makes of a forward's inner loop: the kernel compiled for sm_90a on any machine (no GPU), its
SASS disassembled (Triton's nvdisasm), and the instructions of the innermost loop that holds the tile's MMAs counted
by opcode; plus whether ptxas serialises the kernel's wgmma instructions.

    python scripts/sass_loop.py int8 --rows 128 --warps 4 --stages 3
    python scripts/sass_loop.py bf16 --rows 128 --warps 4 --stages 3

Counts are per warp and per iteration of the loop (SUB_N keys of ROWS query rows); they depend on the Triton
version (the GPU machine's is the one that matters: ``pip install triton==<its version>`` in a scratch
environment). Nothing runs on a GPU.
"""
from __future__ import annotations

import argparse
import collections
import inspect
import re
import subprocess
import sys
import tempfile
from pathlib import Path

_INSTRUCTION = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")
_LABEL = re.compile(r"\.L_x_(\d+):")
_BRANCH = re.compile(r"\s+/\*([0-9a-f]{4,})\*/.*BRA.*\.L_x_(\d+)")


def _argument_type(name: str, constexprs: dict, sub_n: int, head_dim: int, int8: bool) -> str:
    """Triton signature type of a forward's argument (K and V through tensor descriptors; the int8 forward's K as
    int8 and V as e4m3 [B, H, D, M])."""
    if name in constexprs:
        return "constexpr"
    if name == "K":
        return f"tensordesc<{'i8' if int8 else 'bf16'}[1, 1, {sub_n}, {head_dim}]>"
    if name == "V":
        return f"tensordesc<fp8e4nv[1, 1, {head_dim}, {sub_n}]>" if int8 else f"tensordesc<bf16[1, 1, {sub_n}, {head_dim}]>"
    fixed = {"Q": "*bf16", "Q8": "*i8", "Out": "*bf16", "KvCount": "*i32", "KvIndex": "*i32", "scale_log2": "fp32"}
    if name in fixed:
        return fixed[name]
    return "*fp32" if name[0].isupper() and name not in ("H", "N", "M") and not name.startswith("NUM") else "i32"


def compile_forward(kind: str, rows: int, sub_n: int, warps: int, stages: int, head_dim: int = 128,
                    maxnreg: int | None = None):
    """The compiled int8 or bf16 forward (Triton's CompiledKernel) for a 128x64 mask, K and V by descriptor;
    ``maxnreg`` caps the registers per thread (more programs per SM)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from sparsevid.ops import triton_attention, triton_int8_attention

    kernel = (triton_int8_attention._bsa_int8_fwd_kernel if kind == "int8" else triton_attention._bsa_fwd_kernel).fn
    names = list(inspect.signature(kernel.fn).parameters)
    constexprs = {"HEAD_DIM": head_dim, "BLOCK_D": head_dim, "BLOCK_M": 128, "BLOCK_N": 64, "USE_TMA": True,
                  "ROWS": rows, "SUB_N": sub_n, "DOT_PRECISION": "tf32", "WITH_MASS": False}
    constexprs = {k: v for k, v in constexprs.items() if k in names}
    signature = {n: _argument_type(n, constexprs, sub_n, head_dim, kind == "int8") for n in names}
    return triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages,
                                                          **({"maxnreg": maxnreg} if maxnreg else {})})


def loop_histogram(sass: str) -> collections.Counter:
    """Opcode counts of the innermost loop that holds MMA instructions: the smallest backward branch's span with
    any."""
    label_at, pending = {}, None
    for line in sass.splitlines():
        label = _LABEL.match(line.strip())
        if label:
            pending = label.group(1)
            continue
        instruction = _INSTRUCTION.match(line)
        if instruction and pending is not None:
            label_at[pending], pending = int(instruction.group(1), 16), None
    instructions = [(int(m.group(1), 16), m.group(2).split(".")[0]) for m in map(_INSTRUCTION.match, sass.splitlines())
                    if m]
    best = None
    for line in sass.splitlines():
        branch = _BRANCH.match(line)
        if not branch or label_at.get(branch.group(2), 1 << 62) >= int(branch.group(1), 16):
            continue
        start, end = label_at[branch.group(2)], int(branch.group(1), 16)
        counts = collections.Counter(op for at, op in instructions if start <= at <= end)
        mmas = sum(n for op, n in counts.items() if op.endswith("GMMA"))
        key = -sum(counts.values())
        if mmas and (best is None or key > best[0]):
            best = (key, counts)
    if best is None:
        raise ValueError("no loop with MMA instructions in this SASS")
    return best[1]


def ptxas_report(ptx: str) -> str:
    """What ptxas (Triton's, for sm_90a) says of a kernel's PTX with -v: registers, spills, and whether it
    serialises the kernel's wgmma instructions."""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "kernel.ptx"
        source.write_text(ptx)
        done = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", str(source), "-o", str(Path(tmp) / "x")],
                              capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(done.stderr)
    return done.stderr


def serialized(report: str) -> bool:
    """Whether a ptxas report says it serialises the kernel's wgmma instructions, waiting for each MMA before the
    next is issued. It does so for the whole kernel as soon as one instruction reads an MMA's accumulator before
    the MMA completes, as Triton's ``max_num_imprecise_acc`` promotion does."""
    return "wgmma.mma_async instructions are serialized" in report


def spill_bytes(report: str) -> int:
    """Bytes of spill stores in a ptxas report (all functions)."""
    return sum(int(n) for n in re.findall(r"(\d+) bytes spill stores", report))


def analyse(kernel) -> dict:
    """{"loop": opcode counts, "instructions": their sum, "serialized": ptxas's verdict, "registers", "spill_bytes"}."""
    from triton.backends.nvidia.compiler import get_ptxas

    tools = Path(get_ptxas(90).path).parent
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        sass = subprocess.run([str(tools / "nvdisasm"), "-c", str(cubin)], capture_output=True, text=True,
                              check=True).stdout
    report = ptxas_report(kernel.asm["ptx"])
    counts = loop_histogram(sass)
    registers = re.search(r"Used (\d+) registers", report)
    return {"loop": dict(counts.most_common()), "instructions": sum(counts.values()), "serialized": serialized(report),
            "registers": int(registers.group(1)) if registers else None, "spill_bytes": spill_bytes(report)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kind", choices=("int8", "bf16"))
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--sub-n", type=int, default=64)
    parser.add_argument("--warps", type=int, default=4)
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--maxnreg", type=int, default=None, help="registers per thread at most (default: no cap)")
    args = parser.parse_args()
    result = analyse(compile_forward(args.kind, args.rows, args.sub_n, args.warps, args.stages, maxnreg=args.maxnreg))
    cap = f", at most {args.maxnreg} registers" if args.maxnreg else ""
    print(f"{args.kind} forward, {args.rows} rows x {args.sub_n} keys, {args.warps} warps, {args.stages} stages{cap}: "
          f"{result['instructions']} instructions per loop iteration and warp; wgmma "
          f"{'serialized' if result['serialized'] else 'pipelined'}; {result['registers']} registers, "
          f"{result['spill_bytes']} bytes of spill stores")
    print(result["loop"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
