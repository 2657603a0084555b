"""The end-to-end quality study of the quantized forwards on an untrained tiny built-in model (CPU: the PyTorch
emulation of the quantization; the numbers mean nothing about the GPU kernels)."""
import json

import pytest
from sparsevid_lab.studies.quantized_quality import main as study


def test_the_study_compares_each_precision_with_the_native_sparse_setting(tmp_path):
    report = study(["--out", str(tmp_path), "--tiny", "--device", "cpu", "--steps", "2", "--captions", "1",
                    "--heldout-per-bin", "1", "--noise-bins", "2", "--block-q", "64", "--block-k", "64",
                    "--sparsities", "0.5", "--replay-masks"])
    assert json.loads((tmp_path / "results.json").read_text())["comparison"] == report["comparison"]
    assert "| 50% | int8 |" in (tmp_path / "results.md").read_text()
    assert set(report["settings"]) == {"native top-k 50%", "int8 top-k 50%", "fp8 top-k 50%",
                                       "native (gather) top-k 50%"}
    for name, row in report["settings"].items():
        assert row["sparsity"] == pytest.approx(0.5, abs=0.15), name  # 4 x 4 tiles: top-k 50% keeps 2 of 4
        assert row["velocity_error"] > 0 and row["psnr"] > 0
    assert report["configs"]["int8 top-k 50%"]["precision"] == "int8"
    assert report["configs"]["native top-k 50%"]["backend"] == "reference"  # the same backend for all on the CPU
    assert [row["precision"] for row in report["comparison"]] == ["int8", "fp8", "native (gather)"]
    assert report["configs"]["native (gather) top-k 50%"]["backend"] == "gather"
    assert "out" not in report["args"] and report["args"]["floor_backend"] == "gather"  # no folder of this machine
    for row in report["comparison"]:
        # quantized and native differ (the quantization acts), but by far less than sparse differs from dense
        native = report["settings"]["native top-k 50%"]
        assert row["psnr_vs_native"] > native["psnr"] and row["velocity_ratio"] != 1.0
        assert row["psnr_bar_met"] == (row["psnr_vs_native_min"] >= 30.0)
        assert row["velocity_bar_met"] == (row["velocity_ratio"] <= 1.10)
    # the same settings sampled again with the native run's masks replayed: quantized clips still differ
    assert [row["precision"] for row in report["replayed_masks"]] == ["int8", "fp8", "native (gather)"]
    for row in report["replayed_masks"]:
        assert 0 < row["psnr_vs_native"] < float("inf") and row["psnr_bar_met"] == (row["psnr_vs_native_min"] >= 30.0)
    assert "masks replayed" in (tmp_path / "results.md").read_text()
