"""The benchmarks: one package, one registry run by one entry point, one current result per benchmark and GPU
written through the shared run metadata."""
import argparse
import importlib
import json
import re
import sys
from pathlib import Path

import pytest

from benchmarks.__main__ import main as run_benchmarks
from benchmarks.registry import BENCHMARKS, RESULTS
from benchmarks.report import gpu_slug, write_result
from benchmarks.run_info import recorded_args, run_metadata

PACKAGE = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPTS = sorted(p for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
BENCHMARK_MODULES = [p for p in SCRIPTS if p.stem != "__main__" and re.search(r"^def main\(", p.read_text(), re.M)]
RESULT_KINDS = (".json", ".md", ".png")


def test_benchmarks_is_a_package_without_sys_path_edits():
    assert (PACKAGE / "__init__.py").exists()
    local = {p.stem for p in SCRIPTS}
    for script in SCRIPTS:
        text = script.read_text()
        assert "sys.path" not in text, script.name
        siblings = re.findall(r"^\s*from (\w+) import", text, flags=re.M)
        assert not set(siblings) & local, f"{script.name} imports a sibling without the benchmarks. prefix"


def test_registry_runs_every_benchmark_module():
    registered = {bench.module for bench in BENCHMARKS.values()}
    assert registered == {f"benchmarks.{p.stem}" for p in BENCHMARK_MODULES}
    for name, bench in BENCHMARKS.items():
        assert re.fullmatch(r"[a-z0-9_]+", name) and bench.description and "\n" not in bench.description, name


@pytest.mark.parametrize("script", BENCHMARK_MODULES, ids=lambda p: p.stem)
def test_every_benchmark_writes_through_the_shared_metadata(script):
    text = script.read_text()
    assert "run_metadata(" in text and "write_result(" in text
    assert "get_device_name" not in text and "__version__" not in text  # recorded in one place only
    assert not re.search(r"write_text\(|savefig\(|json\.dump\(|open\(", text), "files are written by write_result"


def test_list_names_every_benchmark(capsys):
    assert run_benchmarks(["--list"]) == 0
    listed = capsys.readouterr().out
    assert all(re.search(rf"^{name} ", listed, re.M) for name in BENCHMARKS)


def test_runner_leaves_out_to_itself():
    with pytest.raises(SystemExit):
        run_benchmarks(["attention_cpu", "--out", "elsewhere"])


def test_a_benchmark_run_writes_its_current_result_per_gpu(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # the runner sets sys.argv for the module
    options = ["--tokens", "256", "--heads", "1", "--head-dim", "16", "--sparsities", "0.5", "--rounds", "1"]
    for _ in range(2):  # a second run replaces the first
        assert run_benchmarks(["--results", str(tmp_path), "attention_cpu", *options]) == 0
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == ["cpu.json", "cpu.md"]
    result = json.loads((tmp_path / "attention_cpu" / "cpu.json").read_text())
    assert result["meta"]["commit"] and result["meta"]["device"] == "cpu" and result["rows"]
    assert result["meta"]["commit"] in (tmp_path / "attention_cpu" / "cpu.md").read_text().splitlines()[0]


@pytest.mark.parametrize(("meta", "slug"), [
    ({"device": "cuda", "gpu": "NVIDIA H200"}, "h200"),
    ({"device": "cuda", "gpu": "NVIDIA H100 80GB HBM3"}, "h100_80gb_hbm3"),
    ({"device": "cuda", "gpu": "NVIDIA H200", "gpus": 2}, "h200x2"),
    ({"device": "cpu", "gpu": "x86_64"}, "cpu"),
], ids=["h200", "h100", "two-gpus", "cpu"])
def test_gpu_slug(meta, slug):
    assert gpu_slug(meta) == slug


def test_write_result_replaces_the_previous_figure(tmp_path):
    meta = run_metadata("cpu")
    (tmp_path / "cpu.png").write_bytes(b"stale")
    path = write_result(tmp_path, meta, {"rows": [1]}, "| a |")
    assert path == tmp_path / "cpu.json" and json.loads(path.read_text()) == {"meta": meta, "rows": [1]}
    assert not (tmp_path / "cpu.png").exists()


def test_run_metadata_names_device_versions_commit_and_time():
    meta = run_metadata("cpu", iters=3)
    assert {"device", "gpu", "torch", "triton", "diffusers", "flash_attn_4", "python", "commit", "time",
            "iters"} <= set(meta)
    assert meta["iters"] == 3 and meta["commit"] and "T" in meta["time"]
    json.dumps(meta)


def test_results_hold_one_current_result_per_benchmark_and_gpu():
    files = [p.relative_to(RESULTS) for p in RESULTS.rglob("*") if p.is_file()]
    assert files
    for path in files:
        assert len(path.parts) == 2 and path.parts[0] in BENCHMARKS, f"{path}: not <benchmark>/<gpu>.<kind>"
        assert path.suffix in RESULT_KINDS and re.fullmatch(r"[a-z0-9_]+", path.stem), path
        assert not re.search(r"[0-9a-f]{7}", path.stem), f"{path}: a commit in the name"


def test_result_records_name_no_folder_of_the_machine_they_ran_on():
    """No committed result (benchmarks' or the lab's studies') holds an absolute path: recorded_args leaves the
    output folder out and data sources record folder names."""
    records = [*RESULTS.rglob("*.json"), *(PACKAGE.parent / "lab" / "results").rglob("*.json")]
    assert len(records) > 10
    for path in records:
        assert not re.search(r'"/[A-Za-z]', path.read_text()), f"{path}: an absolute path"


def test_recorded_args_leave_the_output_folder_out():
    args = argparse.Namespace(out=Path("/somewhere/result"), steps=3, shapes=["a", "b"])
    assert recorded_args(args) == {"steps": "3", "shapes": "['a', 'b']"}


def test_gpu_session_runs_benchmarks_through_the_registry_and_studies_from_the_lab():
    text = (PACKAGE / "gpu_session.sh").read_text()
    assert not re.search(r"-m benchmarks\.", text), "a module run directly instead of by its registered name"
    names = re.findall(r"^\s+(?:family_)?bench (\w+)", text, flags=re.M) + re.findall(
        r'-m benchmarks --results "\$RESULTS" (\w+)', text)
    assert "families_compiled_mochi" in names  # the families parts too
    assert names and set(names) <= set(BENCHMARKS), set(names) - set(BENCHMARKS)
    assert "sparsevid_lab.studies." in text


def test_benchmarks_import_each_other_as_a_package():
    module = importlib.import_module("benchmarks.bench_distill")
    assert module.build_transformer is importlib.import_module("benchmarks.bench_e2e").build_transformer


def test_no_per_step_logs_are_committed():
    assert not [p for p in RESULTS.rglob("*") if p.suffix in (".jsonl", ".log", ".csv")]
