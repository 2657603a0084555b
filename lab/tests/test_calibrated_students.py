"""Students distilled with the per-head calibrated mask plan against global top-k (the claims grid with
``--rules per-head topk``), end to end on the untrained tiny model at a 1,024-token clip (8 x 16 tiles of 128 x
64): the library's calibration file, the plan it loads, both students trained and evaluated at matching sparsity,
and the report's rows and verdict.

The untrained model's heads all attend nearly uniformly, so they would all take one setting at a sparsity that one
setting reaches. At 70% top-k keeps ceil(0.3 x 16) = 5 key blocks per row (68.75% sparse), which no candidate
reaches in every head (top-k 0.35 keeps 6, 0.25 keeps 4): the per-head plan must mix settings to remove the same
share."""
import json

import pytest

pytest.importorskip("diffusers")

from sparsevid_lab.studies import claims_grid  # noqa: E402
from sparsevid_lab.studies.claims_report import SPARSITY_TOLERANCE, per_head_claims  # noqa: E402

import sparsevid as sv  # noqa: E402
from sparsevid.plan.calibration import Calibration  # noqa: E402

ARMS = ["--tiny", "--device", "cpu", "--clip", "4,64,64", "--targets", "0.7", "--rules", "per-head", "topk",
        "--objectives", "distill", "--steps", "1", "--batch", "2", "--clips", "2", "--captions", "1",
        "--heldout-per-bin", "1", "--noise-bins", "2", "--sample-steps", "2"]


def test_per_head_and_top_k_students_at_the_same_sparsity(tmp_path):
    out = tmp_path / "grid"
    assert claims_grid.main(["--out", str(out), "--part", "calibrate", "train", "report", *ARMS]) == 0

    rules = json.loads((out / "calibration.json").read_text())["rules"]
    topk, per_head = rules["topk 70%"], rules["per-head 70%"]
    assert topk["achieved"] == 0.6875 and per_head["aimed"] == 0.6875  # 5 of 16 key blocks per row
    assert per_head["achieved"] == pytest.approx(0.6875, abs=1e-4) and per_head["within_one_point"]  # of top-k
    calibration = Calibration.load(out / "heads_calibration.json")  # the library's file, with its heat map
    assert calibration.model == {"family": "wan", "class_name": "WanTransformer3DModel", "heads": [2]}
    assert calibration.inputs["steps"] == 2 and calibration.inputs["seconds"] > 0
    assert (out / "heads_calibration.png").is_file()
    plan = sv.SparseConfig.from_dict(per_head["config"])
    assert plan == sv.SparseConfig.from_calibration(out / "heads_calibration.json", target_sparsity=0.6875)
    (layer,) = plan.layer_overrides.values()
    assert sorted(layer["topk"]) == [0.25, 0.35] and list(layer["topp"]) == [1e-6, 1e-6]  # 4 and 6 key blocks

    grid = json.loads((out / "grid.json").read_text())
    assert grid["missing"] == [] and set(grid["students"]) == {"distill_per-head_70", "distill_topk_70"}
    students = grid["students"]
    assert students["distill_per-head_70"]["config"] == per_head["config"]  # trained and judged with that plan
    for student in students.values():
        assert student["training"]["steps"] == 1 and student["psnr"] > 0
        assert 0 < student["velocity_error"]["overall"] < 1 and student["heldout_loss"]["overall"] > 0
    gap = students["distill_per-head_70"]["sparsity"] - students["distill_topk_70"]["sparsity"]
    assert students["distill_topk_70"]["sparsity"] == pytest.approx(0.6875) and abs(gap) <= SPARSITY_TOLERANCE
    (claim,) = per_head_claims(grid)
    assert claim["verdict"] in ("confirmed", "not confirmed") and "within 0.01" in claim["evidence"][-1]
    text = (out / "grid.md").read_text()
    assert "| distill_per-head_70 |" in text and "| distill_topk_70 |" in text
    assert "per-head calibrated mask plan beats the global top-k rule" in text

    before = json.loads((out / "heads_calibration.json").read_text())["inputs"]
    assert claims_grid.main(["--out", str(out), "--part", "calibrate", *ARMS, "--targets", "0.7", "0.8"]) == 0
    assert json.loads((out / "heads_calibration.json").read_text())["inputs"] == before  # measured once
    assert json.loads((out / "calibration.json").read_text())["rules"]["per-head 70%"] == per_head  # kept


def test_the_verdict_needs_matching_sparsities():
    entry = {"psnr": 20.0, "velocity_error": {"overall": 0.1}, "sparsity": 0.95}
    grid = {"settings": {"targets": [0.95]},
            "students": {"distill_per-head_95": {**entry, "psnr": 21.0, "velocity_error": {"overall": 0.09}},
                         "distill_topk_95": entry}}
    assert per_head_claims(grid)[0]["verdict"] == "confirmed"
    grid["students"]["distill_per-head_95"]["sparsity"] = 0.95 - 2 * SPARSITY_TOLERANCE
    assert per_head_claims(grid)[0]["verdict"] == "not comparable"
    del grid["students"]["distill_topk_95"]
    assert per_head_claims(grid)[0]["verdict"] == "not measured"
    assert per_head_claims({"settings": {"targets": [0.95]}, "students": {"distill_topk_95": entry}}) == []
