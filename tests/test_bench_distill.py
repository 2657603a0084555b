"""The fine-tuning step benchmark on the CPU at a shrunk size: rows and speed-ups, and the rows a run cut short
keeps (a GPU run under a time limit writes its result after every row)."""
import json

import pytest

pytest.importorskip("diffusers")

from benchmarks import bench_distill  # noqa: E402

SHRUNK = ["--device", "cpu", "--objectives", "diffusion", "--trainable", "attention", "--checkpointing", "on",
          "--layers", "1", "--heads", "2", "--grid", "2x8x8", "--text-tokens", "8", "--warmup", "0", "--iters", "1"]


def test_dense_and_sparse_steps_are_timed_and_compared(tmp_path):
    bench_distill.main(["--out", str(tmp_path), *SHRUNK])
    rows = json.loads((tmp_path / "cpu.json").read_text())["rows"]
    assert [r["student"] for r in rows] == ["dense", "sparse"]
    dense, sparse = rows
    assert dense["speedup_vs_dense_step"] == 1.0
    assert sparse["speedup_vs_dense_step"] == pytest.approx(dense["step_ms"] / sparse["step_ms"])
    assert sparse["sparse_config"]["topk"] == 0.05 and dense["sparse_config"] is None


def test_a_run_cut_short_keeps_the_rows_it_finished(tmp_path, monkeypatch):
    timed = bench_distill.time_configuration

    def time_limit_after_first(args, config, source, distill_config, device):
        if distill_config.sparse is not None:  # the second row: as if the time limit stopped the run here
            raise KeyboardInterrupt
        return timed(args, config, source, distill_config, device)

    monkeypatch.setattr(bench_distill, "time_configuration", time_limit_after_first)
    with pytest.raises(KeyboardInterrupt):
        bench_distill.main(["--out", str(tmp_path), *SHRUNK])
    rows = json.loads((tmp_path / "cpu.json").read_text())["rows"]
    assert [(r["student"], r["speedup_vs_dense_step"]) for r in rows] == [("dense", 1.0)]
    assert "| dense |" in (tmp_path / "cpu.md").read_text()
