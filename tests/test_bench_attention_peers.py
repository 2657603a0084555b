"""The peers benchmark's CPU parts: sparsevid's mask as FlashInfer's Hopper block map, the table of what ran and
why the rest did not, and the slim FlashInfer wheel the benchmark carries."""
import base64
import hashlib
import zipfile

import pytest
import torch

import sparsevid as sv
from benchmarks.bench_attention_peers import flashinfer_blocks, markdown
from benchmarks.peer_wheels import dropped, slim_wheel


def test_flashinfer_blocks_repeat_each_query_block_as_64_row_blocks_per_head():
    generator = torch.Generator().manual_seed(0)
    keep = torch.rand(1, 3, 4, 7, generator=generator) < 0.4
    mask = sv.SparseMask.from_dense(keep, 7 * 64, 7 * 64, 128, 64)  # 4 query blocks of 128, the last half used
    blocks = flashinfer_blocks(mask)
    assert blocks.shape == (3, 7, 7) and blocks.dtype == torch.bool
    for row in range(7):
        assert torch.equal(blocks[:, row], keep[0, :, row // 2])


@pytest.mark.parametrize("batch, block_k, length", [(2, 64, 512), (1, 128, 512), (1, 64, 500)])
def test_flashinfer_blocks_refuse_what_the_kernels_do_not_take(batch, block_k, length):
    keep = torch.ones(batch, 2, -(-length // 128), -(-length // block_k), dtype=torch.bool)
    with pytest.raises(ValueError, match="64-token key blocks"):
        flashinfer_blocks(sv.SparseMask.from_dense(keep, length, length, 128, block_k))


def test_the_table_gives_times_for_peers_that_ran_and_the_reason_for_the_others():
    common = {"shape": "wan1.3b-480p", "sparsity": 0.95}
    table = markdown([{**common, "peer": "sparsevid bf16", "ran": True, "ms": 0.69, "x_cudnn": 16.8},
                      {**common, "peer": "sageattention (dense)", "ran": True, "ms": 9.0, "x_cudnn": 1.3,
                       "ms_at_kept_share": 0.45, "cosine": 0.9991, "rel_l1": 0.031},
                      {**common, "peer": "flashinfer block-sparse bf16", "ran": False,
                       "why": "ModuleNotFoundError: No module named 'flashinfer'"}])
    lines = table.splitlines()
    assert "| 0.690 | 16.8x | - | - | |" in lines[2]
    assert "| 9.000 | 1.3x | 0.450 | 0.99910 / 0.0310 | |" in lines[3]
    assert lines[4].endswith("| - | - | - | - | ModuleNotFoundError: No module named 'flashinfer' |")


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
    assert slim_wheel(source, target) == (5, 3)
    with zipfile.ZipFile(target) as slim:
        names = set(slim.namelist())
        record = slim.read("flashinfer_python-1.0.dist-info/RECORD").decode().splitlines()
        payload = {name: slim.read(name) for name in names}
    assert names == {n for n in members if not dropped(n)} | {"flashinfer_python-1.0.dist-info/RECORD"}
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
