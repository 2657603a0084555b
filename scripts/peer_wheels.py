"""The wheels the peers benchmark (``attention_peers``) carries to a GPU machine that has no package index: FlashInfer,
slimmed to fit the carry limit, and what it imports that a PyTorch install lacks; SageAttention; and, from a local
clone, SpargeAttn's sources (it has no wheel: ``gpu_session.sh peers_build`` compiles it there).

FlashInfer's wheel (about 100 MB) is mostly CUDA sources of kernels it compiles at first use (MoE, sampling,
GEMM, the experimental and Blackwell attention packages). The slim copy keeps every Python file, the headers, and
the sources of the one kernel family the benchmark runs (the Hopper block-sparse "cake" kernels,
``flashinfer/cake_vsa_sm90_backend``), and drops the other kernel sources; its RECORD lists what it holds.

    python scripts/peer_wheels.py --out .whl/peers [--spargeattn-git SpargeAttn/.git]
    # then carry .whl: gpu_session.sh peers_build compiles SpargeAttn, gpu_session.sh peers installs the rest and runs

flash-attn-4 (FlashAttention's CuTe DSL kernels) needs NVIDIA's CUTLASS DSL, whose compiler library alone is a
92 MB wheel that no single carry holds. ``--flash-attn-4 DIR`` downloads its wheels and cuts them into pieces laid
in order into folders DIR/1, DIR/2, ... of at most ``--folder-mib`` each, one folder per call; on the GPU machine
``--join DIR --into WHEELS [--unpack SITE]`` puts the wheels back together from the folders the calls left there
(and extracts them into SITE, a folder for PYTHONPATH):

    python scripts/peer_wheels.py --flash-attn-4 .whl/fa4    # carry .whl/fa4/1 in one call, .whl/fa4/2 in the next
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
# flash-attn-4 and what it imports beyond PyTorch (apache-tvm-ffi and einops too, which the peers' wheels also hold:
# each set installs alone); the CUTLASS DSL's CUDA 13 build, as the GPU machine's PyTorch is.
# The DSL's Python package (``cutlass.cute``) is in libs-core, which imports the CUDA driver's Python bindings
# (cuda-bindings 13.0, the GPU machine's driver and PyTorch build) and protobuf.
FLASH_ATTN4_PACKAGES = ("flash-attn-4==4.0.0b40", "nvidia-cutlass-dsl==4.8.1", "nvidia-cutlass-dsl-libs-base==4.8.1",
                        "nvidia-cutlass-dsl-libs-core==4.8.1", "nvidia-cutlass-dsl-libs-cu13==4.8.1",
                        "quack-kernels==0.6.5", "torch-c-dlpack-ext==0.1.5", "cuda-bindings==13.0.3",
                        "cuda-pathfinder==1.9.1", "protobuf==7.36.2", "apache-tvm-ffi==0.1.15.post2",
                        "einops==0.8.2")
PART_SUFFIX = ".part"


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


def split_into_folders(files: list[Path], out: Path, folder_bytes: int) -> list[Path]:
    """Cut ``files`` into pieces ``<name>.part<i>-of-<n>`` (i from 000) laid in order into folders out/1, out/2,
    ... of at most ``folder_bytes`` each. Returns the folders."""
    if folder_bytes <= 0:
        raise ValueError(f"folder_bytes must be positive, got {folder_bytes}")
    folders: list[Path] = []
    room = 0
    for file in files:
        data, written = file.read_bytes(), []
        while not written or data:
            if room == 0:
                folders.append(out / str(len(folders) + 1))
                folders[-1].mkdir(parents=True, exist_ok=True)
                room = folder_bytes
            piece, data = data[:room], data[room:]
            written.append(folders[-1] / f"{file.name}{PART_SUFFIX}{len(written):03d}")
            written[-1].write_bytes(piece)
            room -= len(piece)
        for path in written:  # the count, known now, in every piece's name: a join can tell a missing last piece
            path.rename(path.with_name(f"{path.name}-of-{len(written):03d}"))
    return folders


def join_parts(folder: Path, into: Path) -> list[Path]:
    """The files cut by :func:`split_into_folders` under ``folder`` (in its numbered subfolders) put back together
    in ``into``; a ValueError names a file whose pieces are not all there. Returns the files."""
    pieces: dict[str, dict[int, Path]] = {}
    counts: dict[str, int] = {}
    for piece in folder.glob(f"*/*{PART_SUFFIX}*-of-*"):
        name, _, numbers = piece.name.rpartition(PART_SUFFIX)
        index, _, count = numbers.partition("-of-")
        pieces.setdefault(name, {})[int(index)] = piece
        counts[name] = int(count)
    into.mkdir(parents=True, exist_ok=True)
    joined = []
    for name, parts in sorted(pieces.items()):
        if sorted(parts) != list(range(counts[name])):
            raise ValueError(f"{name}: pieces {sorted(parts)} under {folder} of {counts[name]}: carry every folder of "
                             "the split before joining")
        target = into / name
        target.write_bytes(b"".join(parts[i].read_bytes() for i in range(len(parts))))
        joined.append(target)
    return joined


def unpack_wheels(wheels: list[Path], target: Path) -> None:
    """Extract ``wheels`` into ``target``, merging the folders they share. (``pip install --target`` replaces a
    top-level folder that an earlier wheel of the same call created, and the CUTLASS DSL's wheels all write into
    ``nvidia_cutlass_dsl/``.) Their ``.pth`` files are not run: ``site.addsitedir(target)`` runs them."""
    target.mkdir(parents=True, exist_ok=True)
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(target)


def fetch_flash_attn4(out: Path, python_version: str, folder_bytes: int) -> list[Path]:
    """flash-attn-4's wheels (:data:`FLASH_ATTN4_PACKAGES`) cut into carry folders under ``out``."""
    download_dir = out / "download"
    download(FLASH_ATTN4_PACKAGES, download_dir, python_version)
    wheels = sorted(download_dir.glob("*.whl"))
    folders = split_into_folders(wheels, out, folder_bytes)
    for wheel in wheels:
        wheel.unlink()
    download_dir.rmdir()
    return folders


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="folder of the wheels (e.g. .whl/peers)")
    parser.add_argument("--python-version", default="3.12", help="the GPU machine's Python")
    parser.add_argument("--spargeattn-git", type=Path, help="git directory of a SpargeAttn clone to pack")
    parser.add_argument("--flash-attn-4", type=Path, help="folder of flash-attn-4's wheels, cut into carry folders")
    parser.add_argument("--folder-mib", type=int, default=48, help="size of each carry folder of --flash-attn-4")
    parser.add_argument("--join", type=Path, help="a --flash-attn-4 folder whose pieces to put back together")
    parser.add_argument("--into", type=Path, help="where --join writes the wheels")
    parser.add_argument("--unpack", type=Path, help="with --join: a folder to extract the joined wheels into, for "
                        "PYTHONPATH (see unpack_wheels)")
    args = parser.parse_args()
    if args.join is not None:
        if args.into is None:
            parser.error("--join needs --into")
        wheels = join_parts(args.join, args.into)
        for wheel in wheels:
            print(f"{wheel}: {wheel.stat().st_size / 2**20:.1f} MiB")
        if args.unpack is not None:
            unpack_wheels(wheels, args.unpack)
            print(f"{len(wheels)} wheels extracted into {args.unpack}")
        return 0
    if args.flash_attn_4 is not None:
        for folder in fetch_flash_attn4(args.flash_attn_4, args.python_version, args.folder_mib << 20):
            print(f"{folder}: {sum(p.stat().st_size for p in folder.iterdir()) / 2**20:.1f} MiB, one call's carry")
        if args.out is None:
            return 0
    if args.out is None:
        parser.error("--out is needed (or --flash-attn-4, or --join)")
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
