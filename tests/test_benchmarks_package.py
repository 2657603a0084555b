"""The benchmarks are one importable package: no sys.path edits, one run-metadata record."""
import importlib
import json
import re
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPTS = sorted(p for p in BENCHMARKS.glob("*.py") if p.name != "__init__.py")
RESULT_WRITERS = [p for p in SCRIPTS if "results.json" in p.read_text()]


def test_benchmarks_is_a_package_without_sys_path_edits():
    assert (BENCHMARKS / "__init__.py").exists()
    for script in SCRIPTS:
        text = script.read_text()
        assert "sys.path" not in text, script.name
        siblings = re.findall(r"^\s*from (\w+) import", text, flags=re.M)
        local = {p.stem for p in SCRIPTS}
        assert not set(siblings) & local, f"{script.name} imports a sibling without the benchmarks. prefix"


@pytest.mark.parametrize("script", RESULT_WRITERS, ids=lambda p: p.stem)
def test_every_result_writer_records_the_shared_metadata(script):
    text = script.read_text()
    assert "run_metadata(" in text
    assert "get_device_name" not in text and "__version__" not in text  # built in one place only


def test_run_metadata_names_device_versions_commit_and_time():
    from benchmarks.run_info import run_metadata

    meta = run_metadata("cpu", iters=3)
    assert {"gpu", "torch", "triton", "diffusers", "python", "commit", "time", "iters"} <= set(meta)
    assert meta["iters"] == 3 and meta["commit"] and "T" in meta["time"]
    json.dumps(meta)  # written to results.json as it is


def test_benchmarks_import_each_other_as_a_package():
    module = importlib.import_module("benchmarks.bench_distill")
    assert module.build_transformer is importlib.import_module("benchmarks.bench_e2e").build_transformer


def test_no_per_step_logs_are_committed():
    assert not list((BENCHMARKS / "results").rglob("*.jsonl"))
