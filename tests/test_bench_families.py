"""The families benchmark: real configs and token grids, and a CPU smoke run of every family at tiny sizes."""
import dataclasses
import json
import sys

import pytest

pytest.importorskip("diffusers")

from benchmarks.__main__ import main as run_benchmarks  # noqa: E402
from benchmarks.bench_families import FAMILIES, main as run_families  # noqa: E402

SMOKE = ["--device", "cpu", "--dtype", "float32", "--layers", "1", "--heads", "2", "--grid", "2x8x8",
         "--text-tokens", "8", "--compile", "eager", "--warmup", "0", "--iters", "1"]


@pytest.mark.parametrize(("name", "grid"), [
    ("wan22_ti2v", (31, 22, 40)),        # 1280x704, 121 frames, VAE 4x16x16, patch 1x2x2
    ("wan22_a14b", (21, 45, 80)),        # 720p, 81 frames: the Wan 14B row of DESIGN.md
    ("hunyuan_video15", (31, 45, 80)),   # 720p, 121 frames, VAE 4x16x16, no patching
    ("ltx", (21, 16, 24)),               # 768x512, 161 frames, VAE 8x32x32
    ("ltx_13b", (21, 32, 48)),           # 1536x1024, 161 frames
    ("wan_vace", (21, 45, 80)),          # 720p, 81 frames
    ("skyreels_v2", (25, 34, 60)),       # 960x544, 97 frames
    ("hunyuan_video", (33, 45, 80)),     # 720p, 129 frames: the HunyuanVideo row of DESIGN.md
    ("cogvideox", (13, 30, 45)),         # 720x480, 49 frames
    ("mochi", (28, 30, 53)),             # 848x480, 163 frames, VAE 6x8x8, patch 2x2
], ids=lambda value: value if isinstance(value, str) else None)
def test_token_grid_follows_the_pipeline_resolution(name, grid):
    assert FAMILIES[name].grid() == grid


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])  # bf16 as on the GPU: every input in the model's dtype
def test_every_family_runs_dense_and_sparse_on_the_cpu(tmp_path, monkeypatch, dtype):
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # the runner sets sys.argv for the module
    assert run_benchmarks(["--results", str(tmp_path), "families", "--families", ",".join(FAMILIES), *SMOKE,
                           "--dtype", dtype]) == 0
    result = json.loads((tmp_path / "families" / "cpu.json").read_text())
    assert result["errors"] == []
    rows = {(r["family"], r["setting"]): r for r in result["rows"]}
    assert set(rows) == {(name, setting) for name in FAMILIES for setting in ("dense", "top-k 5%", "hybrid")}
    for (name, setting), row in rows.items():
        assert row["forward_ms"] > 0 and row["speedup"] > 0 and row["tokens"] == 2 * 8 * 8, (name, setting)
        if setting == "top-k 5%":  # two key blocks of 64 per row: top-k keeps one
            assert row["achieved_sparsity"] == pytest.approx(0.5) and row["sparse_layers"] >= 1, name
    table = (tmp_path / "families" / "cpu.md").read_text()
    assert all(FAMILIES[name].label in table for name in FAMILIES)


def test_a_failing_family_is_recorded_and_the_next_still_runs(tmp_path, monkeypatch):
    def no_inputs(*args):
        raise RuntimeError("no inputs")

    monkeypatch.setitem(FAMILIES, "ltx", dataclasses.replace(FAMILIES["ltx"], inputs=no_inputs))
    assert run_families(["--out", str(tmp_path), *SMOKE, "--families", "ltx,cogvideox"]) == 1
    result = json.loads((tmp_path / "cpu.json").read_text())
    assert result["errors"] == [{"family": "ltx", "error": "RuntimeError: no inputs"}]
    assert {r["family"] for r in result["rows"]} == {"cogvideox"}
    assert "ltx: failed: RuntimeError: no inputs" in (tmp_path / "cpu.md").read_text()


def test_estimate_names_every_family(capsys):
    assert run_families(["--out", "unused", "--estimate", "--layers", "1", "--heads", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split("|")[1].strip() for line in lines[2:-1]] == list(FAMILIES)


def test_unknown_family_is_refused():
    with pytest.raises(SystemExit):
        run_families(["--out", "unused", "--families", "wan,latte"])
