"""scripts/peer_wheels.py's slim FlashInfer wheel: Python files and the Hopper block-sparse kernels kept, other kernel
sources left out, a RECORD that lists exactly what the wheel holds."""
import base64
import hashlib
import importlib.util
import zipfile
from pathlib import Path

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
