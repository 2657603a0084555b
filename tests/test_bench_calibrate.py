"""The calibration-cost benchmark on the CPU at a shrunk Wan size: every phase timed, the file written and loaded
back onto the model, the measurement bounded by its budget."""
import json
import sys

import pytest

pytest.importorskip("diffusers")

from benchmarks.__main__ import main as run_benchmarks  # noqa: E402
from benchmarks.bench_calibrate import parse_args  # noqa: E402

SHRUNK = ["--device", "cpu", "--dtype", "float32", "--layers", "1", "--heads", "2", "--grid", "2x16x16",
          "--text-tokens", "8"]


def _run(tmp_path, monkeypatch, *options) -> dict:
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # the runner sets sys.argv for the module
    assert run_benchmarks(["--results", str(tmp_path), "calibrate_wan13b", *SHRUNK, *options]) == 0
    return json.loads((tmp_path / "calibrate_wan13b" / "cpu.json").read_text())


def test_every_phase_is_timed_and_the_calibration_loads_onto_the_model(tmp_path, monkeypatch):
    result = _run(tmp_path, monkeypatch, "--inputs", "2")
    seconds = result["seconds"]
    assert result["inputs_measured"] == 2 and len(seconds["measure_per_input"]) == 2
    assert result["calls_per_layer"] == [2]  # one self-attention call per input
    for phase in ("build", "dense_forward", "measure", "choose", "save", "load_and_apply", "sparse_forward"):
        assert seconds[phase] > 0, phase
    assert seconds["measure"] >= sum(seconds["measure_per_input"])
    assert seconds["calibration"] == pytest.approx(seconds["measure"] + seconds["choose"] + seconds["save"])
    # 512 tokens: 4 x 8 tiles of 128 x 64; target 0.95 is out of reach, every head takes its sparsest setting
    # (one key block per row, 7/8 skipped), and the loaded configuration skips as much on the first input.
    assert result["candidates"] == 23 and result["tokens"] == 512
    assert result["calibrated"]["sparsity"] == pytest.approx(0.875)
    assert result["loaded_sparsity"] == pytest.approx(0.875) and result["loads"]
    assert 1000 < result["file_bytes"] < 20000 and result["peak_gpu_gb"] == {"measure": None, "run": None}
    assert result["meta"]["device"] == "cpu" and result["within_issue_target"]
    text = (tmp_path / "calibrate_wan13b" / "cpu.md").read_text()
    assert "| **calibration (measure + choose + save)** |" in text and "2 of 2 inputs measured" in text


def test_no_input_starts_after_the_budget(tmp_path, monkeypatch):
    result = _run(tmp_path, monkeypatch, "--inputs", "3", "--budget-s", "0")
    assert result["inputs_requested"] == 3 and result["inputs_measured"] == 1 and result["calls_per_layer"] == [1]
    assert not result["within_issue_target"]  # not every input was measured
    assert "1 of 3 inputs measured" in (tmp_path / "calibrate_wan13b" / "cpu.md").read_text()


@pytest.mark.parametrize("option", [["--inputs", "0"], ["--target-sparsity", "1"], ["--grid", "2x16"],
                                    ["--block-k", "32"]], ids=["inputs", "target", "grid", "block"])
def test_bad_options_are_refused(option):
    with pytest.raises(SystemExit):
        parse_args(["--out", "unused", *option])


def test_a_file_that_does_not_fit_the_model_is_recorded_as_not_loading(tmp_path):
    import torch

    from benchmarks.bench_calibrate import load_back
    from benchmarks.bench_e2e import MODELS, build_transformer
    from sparsevid.plan.calibration import Calibration, default_candidates

    import sparsevid as sv

    model = build_transformer({**MODELS["wan1.3b"]["config"], "num_layers": 1, "num_attention_heads": 2},
                              torch.device("cpu"), torch.float32)
    candidates = default_candidates()
    table = [[[0.5] * len(candidates)] * 3]  # one layer of 3 heads: not this model's 2
    other = Calibration({"family": "wan", "class_name": "WanTransformer3DModel", "heads": [3]},
                        {"block_q": 128, "block_k": 64, "tile": "auto"}, candidates, table, table, table)
    other.choose(target_sparsity=0.5)
    found = load_back(model, other.save(tmp_path / "other.json"), {}, "auto", torch.device("cpu"))
    assert not found["loads"] and "ValueError" in found["load_error"] and "head" in found["load_error"]
    assert found["loaded_sparsity"] is None and not sv.is_sparse(model)
