"""The wheels the peers benchmark (``attention_peers``) carries to a GPU machine that has no package index: FlashInfer,
slimmed to fit the carry limit, and what it imports that a PyTorch install lacks; SageAttention; and, from a local
clone, SpargeAttn's sources (it has no wheel: ``gpu_session.sh peers_build`` compiles it there).

FlashInfer's wheel (about 100 MB) is mostly CUDA sources of kernels it compiles at first use (MoE, sampling,
GEMM, the experimental and Blackwell attention packages). The slim copy keeps every Python file, the headers, and
the sources of the one kernel family the benchmark runs (the Hopper block-sparse "cake" kernels,
``flashinfer/cake_vsa_sm90_backend``), and drops the other kernel sources; its RECORD lists what it holds.

    python scripts/peer_wheels.py --out .whl/peers [--spargeattn-git SpargeAttn/.git]
    # then carry .whl: gpu_session.sh peers_build compiles SpargeAttn, gpu_session.sh peers installs the rest and runs
"""
from __future__ import annotations

import argparse
import base64
import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path

# Requirements of the peers beyond what the GPU machine has (PyTorch, Triton, requests, numpy, ...).
PEER_PACKAGES = ("flashinfer-python", "apache-tvm-ffi<0.2,>=0.1.11", "nvidia-ml-py", "ninja", "einops", "tabulate",
                 "sageattention")
KEPT_KERNEL_SOURCES = "flashinfer/cake_vsa_sm90_backend/"
DROPPED_SOURCE_DIRS = ("/csrc/", "/kernel_src/", "flashinfer/experimental/")
# What SpargeAttn's setup.py builds from (its examples, assets and evaluation videos left out).
SPARGEATTN_PATHS = ("setup.py", "LICENSE", "README.md", "requirements.txt", "csrc", "spas_sage_attn", "tools")
SPARGEATTN_ARCHIVE = "spargeattn-src.tar.gz"


def dropped(member: str) -> bool:
    """Whether the slim FlashInfer wheel leaves ``member`` out: a non-Python file in a kernel-source folder
    (other than the Hopper block-sparse kernels') or in the experimental packages."""
    if member.endswith(".py") or member.startswith(KEPT_KERNEL_SOURCES) or ".dist-info/" in member:
        return False
    return any(part in member for part in DROPPED_SOURCE_DIRS)


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def slim_wheel(source: Path, target: Path) -> tuple[int, int]:
    """Write ``source`` (a wheel) to ``target`` without the :func:`dropped` members, its RECORD rewritten to
    list exactly what ``target`` holds. Returns the member counts (kept, dropped)."""
    kept = left_out = 0
    with zipfile.ZipFile(source) as wheel, zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as slim:
        record_name = next(n for n in wheel.namelist() if n.endswith(".dist-info/RECORD"))
        lines = []
        for info in wheel.infolist():
            if info.filename == record_name or info.is_dir():
                continue
            if dropped(info.filename):
                left_out += 1
                continue
            data = wheel.read(info)
            slim.writestr(info, data)
            lines.append(_record_line(info.filename, data))
            kept += 1
        slim.writestr(record_name, "\n".join([*lines, f"{record_name},,"]) + "\n")
    return kept, left_out


def download(packages: tuple[str, ...], out: Path, python_version: str) -> None:
    """pip download of ``packages`` (no dependencies, binary wheels for CPython ``python_version`` on x86-64
    manylinux) into ``out``."""
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version",
                    python_version, "--implementation", "cp", "--platform", "manylinux_2_28_x86_64", "--platform",
                    "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64", "-d", str(out), *packages],
                   check=True)


def pack_spargeattn(git_dir: Path, out: Path) -> Path:
    """SpargeAttn's build sources at the HEAD of the clone whose git directory is ``git_dir``, as
    ``out/spargeattn-src.tar.gz`` (one top folder, ``SpargeAttn/``)."""
    archive = out / SPARGEATTN_ARCHIVE
    subprocess.run(["git", "--git-dir", str(git_dir), "archive", "--format=tar.gz", "--prefix=SpargeAttn/", "-o",
                    str(archive), "HEAD", *SPARGEATTN_PATHS], check=True)
    return archive


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder of the wheels (e.g. .whl/peers)")
    parser.add_argument("--python-version", default="3.12", help="the GPU machine's Python")
    parser.add_argument("--spargeattn-git", type=Path, help="git directory of a SpargeAttn clone to pack")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    download(PEER_PACKAGES, args.out, args.python_version)
    for wheel in sorted(args.out.glob("flashinfer_python-*.whl")):
        slim = wheel.with_suffix(".slim")
        kept, left_out = slim_wheel(wheel, slim)
        slim.replace(wheel)  # the same file name: pip checks it against the wheel's metadata
        print(f"{wheel.name} slimmed: {kept} files kept, {left_out} kernel sources left out, "
              f"{wheel.stat().st_size / 2**20:.1f} MiB")
    if args.spargeattn_git is not None:
        print(f"{pack_spargeattn(args.spargeattn_git, args.out)}: SpargeAttn's sources")
    total = sum(p.stat().st_size for p in args.out.iterdir())
    print(f"{args.out}: {total / 2**20:.1f} MiB to carry")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
