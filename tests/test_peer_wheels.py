"""scripts/peer_wheels.py's slim FlashInfer wheel: Python files and the Hopper block-sparse kernels kept, other kernel
sources left out, a RECORD that lists exactly what the wheel holds; flash-attn-4's wheels cut into carry folders and
joined again."""
import base64
import hashlib
import importlib.util
import zipfile
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location("peer_wheels", Path(__file__).parents[1] / "scripts" / "peer_wheels.py")
peer_wheels = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(peer_wheels)


def test_the_slim_wheel_keeps_python_and_the_hopper_kernels_and_records_what_it_holds(tmp_path):
    members = {
        "flashinfer/__init__.py": b"version = 1\n",
        "flashinfer/data/csrc/moe.cu": b"// a kernel the benchmark does not run\n",
        "flashinfer/data/include/flashinfer/math.cuh": b"// a header\n",
        "flashinfer/fused_moe/kernel_src/gemm.cu": b"// another\n",
        "flashinfer/experimental/blackwell/data.bin": b"\x00\x01",
        "flashinfer/experimental/blackwell/api.py": b"def f(): pass\n",
        "flashinfer/cake_vsa_sm90_backend/csrc/kernel.cu": b"// the Hopper block-sparse kernel\n",
        "flashinfer_python-1.0.dist-info/METADATA": b"Name: flashinfer-python\nVersion: 1.0\n",
    }
    source, target = tmp_path / "full.whl", tmp_path / "slim.whl"
    with zipfile.ZipFile(source, "w") as wheel:
        for name, data in members.items():
            wheel.writestr(name, data)
        wheel.writestr("flashinfer_python-1.0.dist-info/RECORD", "stale,,\n")
    assert peer_wheels.slim_wheel(source, target) == (5, 3)
    with zipfile.ZipFile(target) as slim:
        names = set(slim.namelist())
        record = slim.read("flashinfer_python-1.0.dist-info/RECORD").decode().splitlines()
        payload = {name: slim.read(name) for name in names}
    assert names == {n for n in members if not peer_wheels.dropped(n)} | {"flashinfer_python-1.0.dist-info/RECORD"}
    assert {"flashinfer/data/csrc/moe.cu", "flashinfer/fused_moe/kernel_src/gemm.cu",
            "flashinfer/experimental/blackwell/data.bin"}.isdisjoint(names)
    rows = {line.split(",")[0]: line.split(",")[1:] for line in record}
    assert set(rows) == names
    for name, (digest, size) in rows.items():
        if name.endswith("RECORD"):
            assert digest == size == ""
            continue
        expected = base64.urlsafe_b64encode(hashlib.sha256(payload[name]).digest()).rstrip(b"=").decode()
        assert digest == f"sha256={expected}" and int(size) == len(payload[name])


def test_spargeattn_sources_are_packed_without_its_examples(tmp_path):
    import subprocess
    import tarfile

    clone = tmp_path / "SpargeAttn"
    files = ["setup.py", "LICENSE", "README.md", "requirements.txt", "csrc/qattn/kernel.cu", "spas_sage_attn/core.py",
             "tools/gpu_process.py", "assets/overview.png", "evaluate/wan_example.py"]
    for name in files:
        (clone / name).parent.mkdir(parents=True, exist_ok=True)
        (clone / name).write_text(name)
    git = ["git", "-C", str(clone), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "sources"], check=True)
    archive = peer_wheels.pack_spargeattn(clone / ".git", tmp_path)
    with tarfile.open(archive) as packed:
        members = {m.name for m in packed.getmembers() if m.isfile()}
    assert members == {f"SpargeAttn/{name}" for name in files[:7]}


def test_files_cut_into_carry_folders_come_back_whole_and_no_folder_exceeds_its_size(tmp_path):
    sources = tmp_path / "wheels"
    sources.mkdir()
    contents = {"big.whl": bytes(range(256)) * 10, "small.whl": b"tiny", "mid.whl": b"m" * 900}
    for name, data in contents.items():
        (sources / name).write_bytes(data)
    files = [sources / name for name in contents]
    folders = peer_wheels.split_into_folders(files, tmp_path / "carry", folder_bytes=1000)
    sizes = [sum(p.stat().st_size for p in folder.iterdir()) for folder in folders]
    assert [f.name for f in folders] == ["1", "2", "3", "4"]
    assert sizes == [1000, 1000, 1000, 3464 - 3000]  # 2,560 + 4 + 900 bytes, each folder filled before the next
    joined = peer_wheels.join_parts(tmp_path / "carry", tmp_path / "whole")
    assert {p.name: p.read_bytes() for p in joined} == contents


def test_joining_with_a_folder_missing_names_the_file_whose_pieces_are_incomplete(tmp_path):
    (tmp_path / "big.whl").write_bytes(b"x" * 2500)
    peer_wheels.split_into_folders([tmp_path / "big.whl"], tmp_path / "carry", folder_bytes=1000)
    for piece in (tmp_path / "carry" / "2").iterdir():
        piece.unlink()
    with pytest.raises(ValueError, match=r"big.whl: pieces \[0, 2\] under .* of 3"):
        peer_wheels.join_parts(tmp_path / "carry", tmp_path / "whole")
    for piece in (tmp_path / "carry" / "3").iterdir():  # the last piece missing too: still not taken for whole
        piece.unlink()
    with pytest.raises(ValueError, match=r"big.whl: pieces \[0\] under .* of 3"):
        peer_wheels.join_parts(tmp_path / "carry", tmp_path / "whole")
    with pytest.raises(ValueError, match="folder_bytes"):
        peer_wheels.split_into_folders([tmp_path / "big.whl"], tmp_path / "other", folder_bytes=0)


def test_unpacked_wheels_merge_the_folders_they_share_and_keep_their_pth_files(tmp_path):
    """The CUTLASS DSL's wheels all write into one top-level folder; pip's --target would keep only the last."""
    contents = {"base.whl": {"pkg/dsl/cutlass/_mlir/ir.py": b"x = 1\n", "pkg_base.dist-info/METADATA": b"Name: b\n"},
                "core.whl": {"pkg/dsl/cutlass/cute/__init__.py": b"y = 2\n", "pkg.pth": b"import pkg\n"}}
    wheels = []
    for name, files in contents.items():
        wheels.append(tmp_path / name)
        with zipfile.ZipFile(wheels[-1], "w") as wheel:
            for member, data in files.items():
                wheel.writestr(member, data)
    peer_wheels.unpack_wheels(wheels, tmp_path / "site")
    site = tmp_path / "site"
    assert (site / "pkg/dsl/cutlass/_mlir/ir.py").read_bytes() == b"x = 1\n"
    assert (site / "pkg/dsl/cutlass/cute/__init__.py").read_bytes() == b"y = 2\n"
    assert (site / "pkg.pth").read_bytes() == b"import pkg\n"
