"""The per-head calibration study and `sparsevid_lab calibrate` on an untrained tiny built-in model (CPU smoke runs
of the code the H200 measurement runs; the numbers mean nothing about quality)."""
import json

import pytest
import torch
from sparsevid_lab.cli import build_parser
from sparsevid_lab.cli.demo import load_model
from sparsevid_lab.studies.per_head_calibration import main as study
from sparsevid_lab.eval.heldout import heldout_set, sparse_velocity_errors
from sparsevid_lab.studies.per_head_calibration import parse_args, reused_calibration

import sparsevid as sv
from sparsevid.cli import main as run_command
from sparsevid.plan.calibration import Calibration


def test_the_lab_command_calibrates_the_builtin_model(tmp_path, capsys):
    out = tmp_path / "calibration.json"
    assert run_command(["calibrate", "--tiny", "--device", "cpu", "--steps", "2", "--captions", "1",
                        "--block-q", "64", "--block-k", "64", "--target-sparsity", "0.5", "--out", str(out)],
                       build_parser()) == 0
    assert "all     50.0%" in capsys.readouterr().out
    calibration = Calibration.load(out)
    assert calibration.model["family"] == "wan" and calibration.inputs["steps"] == 2
    # tiny_config: 1 layer of 2 heads; 2 sampler steps with guidance, each layer measured at every forward.
    assert calibration.model["heads"] == [2] and calibration.inputs["calls_per_layer"][0] >= 2
    assert (tmp_path / "calibration.png").is_file()
    assert sv.SparseConfig.from_calibration(out).calibrated_for == {"family": "wan", "heads": [2]}


def test_the_study_writes_its_results_on_a_tiny_model(tmp_path):
    results = study(["--out", str(tmp_path), "--tiny", "--device", "cpu", "--steps", "2", "--captions", "1",
                     "--calib-captions", "1", "--seeds", "0", "--sparsities", "0.5", "--heldout-per-bin", "1",
                     "--noise-bins", "1", "--block-q", "64", "--block-k", "64", "--overhead-calls", "1"])
    assert json.loads((tmp_path / "results.json").read_text())["targets"] == results["targets"]
    assert "per-head 50%" in (tmp_path / "results.md").read_text()
    assert (tmp_path / "calibration_50.png").is_file() and (tmp_path / "calibration.json").is_file()
    (target,) = results["targets"]
    assert target["labels"] == ["per-head 50%", "per-head-abs 50%", "per-head-out 50%", "topk 50%", "topp 50%",
                                "hybrid 50%"]
    assert target["best_global"] in target["labels"][3:]
    for label in target["labels"]:
        row = results["configs"][label]
        # tiny clip: 256 tokens in 4 x 4 tiles of 64; every setting removes about half of them.
        assert row["sparsity"] == pytest.approx(0.5, abs=0.15), label
        assert 0 < row["predicted_recall"] <= row["oracle_recall"] + 1e-9 <= 1 + 1e-9
        assert row["velocity_error"] > 0
    assert set(results["overhead"]) == {"eager"} and results["overhead"]["eager"]["scalar_attention_ms"] > 0
    assert results["calibration"]["seconds"] > 0
    # The saved calibration is reused for the same clip and tiles, refused for others.
    model = load_model(parse_args(["--out", str(tmp_path), "--tiny", "--device", "cpu"]))
    calibration, jobs = reused_calibration(tmp_path / "calibration.json", model, {"block_q": 64, "block_k": 64})
    assert jobs == [tuple(job) for job in results["calibration"]["jobs"]] and calibration.output_error is not None
    with pytest.raises(ValueError, match="was measured at"):
        reused_calibration(tmp_path / "calibration.json", model, {"block_q": 128, "block_k": 64})


def test_the_velocity_metric_alone_compares_on_each_held_out_set(tmp_path):
    calibrated = study(["--out", str(tmp_path / "first"), "--tiny", "--device", "cpu", "--steps", "2",
                        "--calib-captions", "1", "--sparsities", "0.5", "--block-q", "64", "--block-k", "64",
                        "--metrics", "velocity", "--heldout-per-bin", "1", "--noise-bins", "2"])
    assert calibrated["heldout_seeds"] == [sv.eval.HELDOUT_SEED] and calibrated["overhead"] is None
    results = study(["--out", str(tmp_path / "second"), "--tiny", "--device", "cpu", "--steps", "2",
                     "--calibration", str(tmp_path / "first" / "calibration.json"), "--sparsities", "0.5",
                     "--block-q", "64", "--block-k", "64", "--rules", "topk", "--errors", "relative", "output",
                     "--metrics", "velocity", "--heldout-per-bin", "1", "--noise-bins", "2",
                     "--heldout-seeds", "5", "6"])
    (target,) = results["targets"]
    assert target["labels"] == ["per-head 50%", "per-head-out 50%", "topk 50%"] and target["best_global"] == "topk 50%"
    assert results["heldout_seeds"] == [5, 6] and results["overhead"] is None and "settings" not in results
    for label in target["labels"]:
        row = results["configs"][label]
        assert "psnr" not in row and set(row["heldout"]) == {"5", "6"}
        errors = [row["heldout"][seed]["velocity_error"] for seed in ("5", "6")]
        assert all(e > 0 for e in errors) and errors[0] != errors[1]  # two different sets of triples
        assert row["velocity_error"] == pytest.approx(sum(errors) / 2)
        assert all(row["heldout"][seed]["sparsity"] == pytest.approx(0.5, abs=0.15) for seed in ("5", "6"))
    # top-k 50% keeps 2 of each row's 4 key blocks: exactly half of every call, on every set.
    assert [results["configs"]["topk 50%"]["heldout"][s]["sparsity"] for s in ("5", "6")] == [0.5, 0.5]
    assert "velocity error (held-out 5)" in (tmp_path / "second" / "results.md").read_text()


def test_the_achieved_sparsity_and_error_of_each_setting_on_held_out_triples():
    model = load_model(parse_args(["--out", "unused", "--tiny", "--device", "cpu"]))
    heldout = heldout_set(model, per_bin=1, num_bins=2, seed=3)
    assert heldout.seed == 3 and not torch.equal(heldout.noise, heldout_set(model, per_bin=1, num_bins=2, seed=4).noise)
    blocks = {"block_q": 64, "block_k": 64}
    errors = sparse_velocity_errors(model, heldout, {"dense": sv.SparseConfig(rule="topk", topk=1.0, **blocks),
                                                     "quarter": sv.SparseConfig(rule="topk", topk=0.25, **blocks)})
    assert errors["dense"]["velocity_error"] < 1e-5 and errors["dense"]["sparsity"] == 0.0
    assert errors["quarter"]["sparsity"] == 0.75 and errors["quarter"]["velocity_error"] > 1e-3
    assert len(errors["quarter"]["velocity_error_per_bin"]) == 2


def test_the_study_compares_a_calibration_by_noise_range(tmp_path):
    """--noise-splits: the tiny model's two sampler steps (noise levels 1 and about 0.83) fall on either side of 0.9;
    the per-head settings of the pooled measurements equal those of the same study without splits."""
    common = ["--tiny", "--device", "cpu", "--steps", "2", "--captions", "1", "--calib-captions", "1", "--seeds", "0",
              "--sparsities", "0.5", "--heldout-per-bin", "1", "--noise-bins", "1", "--block-q", "64", "--block-k",
              "64", "--metrics", "velocity"]
    split = study(["--out", str(tmp_path / "split"), "--noise-splits", "0.9"] + common)
    whole = study(["--out", str(tmp_path / "whole")] + common)
    (target,) = split["targets"]
    assert "per-head-ranges 50%" in target["labels"] and split["calibration"]["noise_splits"] == [0.9]
    assert sum(split["calibration"]["range_weights"]) == pytest.approx(1.0) and min(
        split["calibration"]["range_weights"]) > 0
    ranges = sv.SparseConfig.from_dict(split["configs"]["per-head-ranges 50%"]["config"])
    assert [entry["noise_range"] for entry in ranges.noise_overrides] == [(0.0, 0.9), (0.9, 1.0)]
    assert split["configs"]["per-head-ranges 50%"]["velocity_error"] > 0
    for label in ("per-head 50%", "per-head-out 50%"):
        assert split["configs"][label]["config"] == whole["configs"][label]["config"], label
    assert (tmp_path / "split" / "calibration_ranges.json").is_file()
    assert (tmp_path / "split" / "calibration_ranges_50.png").is_file()
    reused = study(["--out", str(tmp_path / "reused"), "--calibration",
                    str(tmp_path / "split" / "calibration_ranges.json")] + common)
    assert reused["configs"]["per-head-ranges 50%"]["config"] == split["configs"]["per-head-ranges 50%"]["config"]
