"""The per-head prediction benchmark: its options, and a CPU smoke run of every plan and mode at a tiny shape."""
import json
import sys

import pytest

from benchmarks.__main__ import main as run_benchmarks
from benchmarks.bench_predict_per_head import TOPK, parse_args, plan_budgets


def test_the_varied_plan_spreads_the_budget_around_the_same_mean():
    budgets = plan_budgets(12)
    assert budgets["scalar"] == TOPK and budgets["same"] == [TOPK] * 12
    varied = budgets["varied"]
    assert len(set(varied)) == 12 and sum(varied) / 12 == pytest.approx(TOPK, rel=1e-12)
    assert min(varied) == pytest.approx(TOPK / 2) and max(varied) == pytest.approx(TOPK * 1.5)


@pytest.mark.parametrize("option", [["--shapes", "wan2"], ["--modes", "eager,jit"], ["--blocks", "128"],
                                    ["--rounds", "0"]], ids=["shape", "mode", "blocks", "rounds"])
def test_bad_options_are_refused(option):
    with pytest.raises(SystemExit):
        parse_args(["--out", "unused", *option])


def test_every_plan_and_mode_runs_on_the_cpu(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # the runner sets sys.argv for the module
    assert run_benchmarks(["--results", str(tmp_path), "predict_per_head", "--shapes", "tiny", "--backend",
                           "reference", "--compile-backend", "aot_eager", "--rounds", "1"]) == 0
    result = json.loads((tmp_path / "predict_per_head" / "cpu.json").read_text())
    rows = {(row["mode"], row["plan"]): row for row in result["rows"]}
    assert set(rows) == {(mode, plan) for mode in ("eager", "compiled") for plan in ("scalar", "same", "varied")}
    for row in rows.values():
        assert row["predict"]["do_bench_ms"] > 0 and row["attention"]["do_bench_ms"] > 0
        assert row["tile_sparsity"] == rows["eager", "scalar"]["tile_sparsity"]  # 2 heads: 1 + 3 = 2 + 2 tiles
    assert [(entry["mode"], entry["plan"]) for entry in result["overhead"]] == [
        ("eager", "same"), ("eager", "varied"), ("compiled", "same"), ("compiled", "varied")]
    assert "| tiny | compiled | varied |" in (tmp_path / "predict_per_head" / "cpu.md").read_text()
