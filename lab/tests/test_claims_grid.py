"""The claims grid (benchmarks/claims_grid.py) end to end on the tiny model, and its report's verdicts."""
import copy
import json

import pytest

pytest.importorskip("diffusers")

from sparsevid_lab.studies import claims_grid  # noqa: E402
from sparsevid_lab.studies.claims_report import beats, claims, grid_markdown  # noqa: E402

TINY = ["--tiny", "--device", "cpu", "--targets", "0.75", "--rules", "hybrid", "--steps", "1", "--batch", "2",
        "--clips", "2", "--captions", "1", "--heldout-per-bin", "1", "--noise-bins", "2", "--sample-steps", "2"]


def test_grid_smoke_run_on_the_tiny_model(tmp_path, capsys):
    import sparsevid as sv
    from sparsevid_lab.data import ProceduralVideos

    out = tmp_path / "grid"
    assert claims_grid.main(["--out", str(out), "--part", "calibrate", *TINY]) == 0
    calibration = json.loads((out / "calibration.json").read_text())["rules"]
    assert set(calibration) == {"topk 75%", "topp 75%", "hybrid 75%"}
    assert calibration["topk 75%"]["achieved"] == 0.75 and calibration["topk 75%"]["within_one_point"]
    more = [*TINY, "--targets", "0.5", "0.75"]  # the later --targets wins
    assert claims_grid.main(["--out", str(out), "--part", "calibrate", *more]) == 0
    both = json.loads((out / "calibration.json").read_text())["rules"]
    assert set(both) == set(calibration) | {"topk 50%", "topp 50%", "hybrid 50%"}
    assert all(both[label] == calibration[label] for label in calibration)  # an earlier target is kept as is

    # 30 s leave no room for a minute of training beside an evaluation: nothing starts
    claims_grid.main(["--out", str(out), "--part", "train", "--budget-minutes", "0.5", *TINY])
    assert "stopping before distill_hybrid_75" in capsys.readouterr().out and not (out / "students").exists()

    assert claims_grid.main(["--out", str(out), "--part", "train", "evaluate", "ship",
                             "--ship-to", str(out / "shipped"), *TINY]) == 0
    grid = json.loads((out / "grid.json").read_text())
    assert grid["missing"] == [] and set(grid["students"]) == {"distill_hybrid_75", "diffusion_hybrid_75",
                                                              "dense_diffusion"}
    assert set(grid["training_free"]) == {"training-free_hybrid_75"}
    slice_ = grid["settings"]["slice"]
    assert slice_["backgrounds"] == ["navy"] and slice_["max_objects"] == 1
    assert not any(ProceduralVideos(**slice_).fits(c) for c in grid["settings"]["captions"])  # held out
    for entry in (*grid["students"].values(), *grid["training_free"].values()):
        assert 0 <= entry["velocity_error"]["overall"] < 1 and entry["faithfulness"]["per_attribute"]
    assert all(s["training"]["steps"] == 1 for s in grid["students"].values())
    assert grid["students"]["dense_diffusion"]["sparsity"] == 0.0
    assert grid["students"]["distill_hybrid_75"]["sparsity"] > 0.5
    assert grid["noise_floor"]["psnr"] > grid["training_free"]["training-free_hybrid_75"]["psnr"]
    assert (out / "grid.png").stat().st_size > 0
    text = (out / "grid.md").read_text()
    assert "distill_hybrid_75" in text and "| target:" in text and "not measured" in text  # claim 2 needs topk, topp
    assert not (out / "work" / "distill_hybrid_75").exists()  # a finished student keeps no training state

    import argparse

    from sparsevid_lab.cli.demo import load_model

    teacher = load_model(argparse.Namespace(tiny=True, model=None, device="cpu", clip=None))  # the tiny base again
    assert sv.load_student(teacher.transformer, out / "shipped").rule == "hybrid"
    assert sv.is_sparse(teacher.transformer)

    capsys.readouterr()
    before = (out / "students" / "distill_hybrid_75" / "eval.json").stat().st_mtime_ns
    assert claims_grid.main(["--out", str(out), "--part", "train", *TINY]) == 0  # resumed: nothing left
    assert "0 students pending" in capsys.readouterr().out
    assert (out / "students" / "distill_hybrid_75" / "eval.json").stat().st_mtime_ns == before


def _entry(psnr, velocity, faithfulness=0.8, loss=0.1):
    return {"psnr": psnr, "ssim": 0.5, "sparsity": 0.95, "velocity_error": {"overall": velocity},
            "heldout_loss": {"overall": loss}, "faithfulness": {"overall": faithfulness, "per_attribute": {}}}


def _grid():
    """A grid at 95% where distillation > diffusion > training-free and hybrid > top-k > top-p."""
    rule_bonus = {"hybrid": 2.0, "topk": 1.0, "topp": 0.0}
    objective_bonus = {"distill": 10.0, "diffusion": 8.0, "training-free": 0.0}
    students, free = {}, {}
    for objective, bonus in objective_bonus.items():
        for rule, extra in rule_bonus.items():
            psnr = 12.0 + bonus + extra
            entry = _entry(psnr, 1.0 / psnr, faithfulness=0.70 + psnr / 100)
            (free if objective == "training-free" else students)[f"{objective}_{rule}_95"] = entry
    students["dense_diffusion"] = _entry(18.0, 0.05, faithfulness=0.80, loss=0.12)
    return {"settings": {"targets": [0.95], "model": "m", "device": "d", "steps": 1, "batch": 1, "clips": 1,
                         "slice": {}, "lr": 1e-4, "trainable": "attention", "captions": ["c"], "seeds": [0],
                         "sample_steps": 10, "guidance": 4.0, "heldout": {"triples": 1}},
            "dense": _entry(None, 0.0, faithfulness=0.95, loss=0.1), "noise_floor": _entry(37.0, 0.005),
            "training_free": free, "students": students, "missing": []}


def test_verdicts_follow_the_numbers():
    grid = _grid()
    verdicts = {c["claim"]: c["verdict"] for c in claims(grid)}
    assert verdicts == {1: "confirmed", 2: "confirmed", 3: "confirmed", "control": "confirmed", "target": "met"}

    flipped = copy.deepcopy(grid)  # diffusion now closer than distillation for top-p
    flipped["students"]["diffusion_topp_95"]["psnr"] = 30.0
    flipped["students"]["diffusion_topp_95"]["velocity_error"]["overall"] = 0.01
    verdicts = {c["claim"]: c["verdict"] for c in claims(flipped)}
    assert verdicts[3] == "not confirmed" and verdicts[1] == "confirmed"

    mixed = copy.deepcopy(grid)  # higher PSNR but a larger velocity error is not "beats"
    mixed["students"]["distill_topk_95"]["psnr"] = 40.0
    assert not beats(mixed["students"]["distill_hybrid_95"], mixed["students"]["distill_topk_95"])
    assert {c["claim"]: c["verdict"] for c in claims(mixed)}[2] == "not confirmed"

    partial = copy.deepcopy(grid)
    del partial["students"]["distill_topp_95"]
    verdicts = {c["claim"]: c["verdict"] for c in claims(partial)}
    assert verdicts[1] == verdicts[2] == verdicts[3] == "not measured" and verdicts["target"] == "met"

    worse = copy.deepcopy(grid)
    worse["students"]["dense_diffusion"]["faithfulness"]["overall"] = 0.99
    worse["students"]["distill_hybrid_95"]["psnr"] = 20.0
    verdicts = {c["claim"]: c["verdict"] for c in claims(worse)}
    assert verdicts["control"] == "not confirmed" and verdicts["target"] == "not met"
    assert "**not met**" in grid_markdown(worse)


def test_evidence_counts_the_clips_each_comparison_wins():
    grid = _grid()
    grid["students"]["distill_hybrid_95"]["psnr_per_clip"] = [20.0, 21.0, 9.0]
    grid["students"]["diffusion_hybrid_95"]["psnr_per_clip"] = [19.0, 22.0, 8.0]
    claim3 = next(c for c in claims(grid) if c["claim"] == 3)
    assert "higher PSNR on 2/3 clips" in claim3["evidence"][0]
    assert "per clip: -" in claim3["evidence"][1]  # entries without per-clip PSNR


def test_plan_of_one_objective_leaves_out_the_other_and_the_dense_control():
    names = [s["name"] for s in claims_grid.student_plan([0.63, 0.95], ["hybrid", "topk"], ["distill"])]
    assert names == ["distill_hybrid_63", "distill_topk_63", "distill_hybrid_95", "distill_topk_95"]
    full = [s["name"] for s in claims_grid.student_plan([0.95], ["hybrid"])]
    assert full == ["distill_hybrid_95", "diffusion_hybrid_95", "dense_diffusion"]


def test_fine_tuning_on_the_whole_distribution_keeps_the_evaluation_outside_the_slice(tmp_path):
    grid = claims_grid.Grid(claims_grid.parse_args(["--out", str(tmp_path), "--part", "plan", "--fine-tune-on",
                                                    "full", *TINY]))
    teacher = grid.teacher()
    assert grid.fine_tuning_data(teacher).config() == teacher.data.config()  # data like pre-training
    assert grid.data_slice(teacher).config()["backgrounds"] == ["navy"]  # what the evaluation lies outside of

    (tmp_path / "context.json").write_text(json.dumps({"slice": {}}))  # a grid of the other arm (the slice)
    with pytest.raises(ValueError, match="its own --out"):
        grid.context()

    report = _grid()
    report["settings"]["fine_tuning"] = "full"
    text = grid_markdown(report)
    assert "clips of the model's whole distribution" in text
    assert "distillation beats the diffusion loss on data like pre-training" in text
    assert "on mismatched data" in grid_markdown(_grid())  # grids without the field fine-tuned on the slice


def _assert_refused(compare, first: dict, second: dict, edit: tuple, match: str):
    """``compare(first, second')`` raises ValueError(match), second' being ``second`` with one value changed:
    edit = ("settings", key, value), or ("dense", yardstick, value) for the teacher's overall figure."""
    section, key, value = edit
    other = copy.deepcopy(second)
    if section == "settings":
        other["settings"][key] = value
    else:
        other["dense"][key]["overall"] = value
    with pytest.raises(ValueError, match=match):
        compare(first, other)


def test_the_two_arms_compare_distillations_lead_pair_by_pair():
    from sparsevid_lab.studies.claims_report import data_arms, data_arms_markdown

    mismatched, matched = _grid(), _grid()
    matched["settings"]["fine_tuning"] = "full"
    for name in ("distill_topk_95", "distill_topp_95", "distill_hybrid_95"):  # a smaller lead on matched data
        matched["students"][name]["psnr"] -= 1.0
        matched["students"][name]["velocity_error"]["overall"] += 0.001
    found = data_arms(mismatched, matched)
    assert found["verdict"] == "confirmed" and len(found["rows"]) == 3
    assert found["larger_on_slice"] == {"psnr": 3, "velocity": 3, "both": 3}
    assert found["rows"][0]["mismatched"][0] == pytest.approx(2.0) and found["rows"][0]["matched"][0] == pytest.approx(1.0)

    matched["students"]["distill_topp_95"]["psnr"] += 5.0  # one pair where matched data give the larger lead
    found = data_arms(mismatched, matched)
    assert found["verdict"] == "not confirmed"
    assert found["larger_on_slice"] == {"psnr": 2, "velocity": 3, "both": 2}
    report = data_arms_markdown(mismatched, matched)
    assert "| topp | 95% | +2.00 | +6.00 |" in report
    assert "in 2 of 3 pairs on both yardsticks (PSNR gain: 2 of 3; velocity-error cut: 3 of 3)" in report

    del matched["students"]["distill_topk_95"], matched["students"]["distill_topp_95"]
    assert len(data_arms(mismatched, matched)["rows"]) == 1  # only the pairs both arms measured
    with pytest.raises(ValueError, match="slice and on the whole distribution"):
        data_arms(matched, mismatched)
    for edit, match in ((("settings", "steps", 600), "differ in steps"),
                        (("settings", "train_shift", 5.0), "differ in train_shift"),
                        (("dense", "faithfulness", 0.5), "dense teacher")):
        _assert_refused(data_arms, mismatched, matched, edit, match)


def test_a_training_variant_compares_student_by_student():
    from sparsevid_lab.studies.claims_report import variant_comparison, variant_markdown

    base, variant = _grid(), _grid()
    variant["settings"]["train_shift"] = 5.0
    del variant["students"]["distill_topp_95"]
    variant["students"]["distill_hybrid_95"]["psnr"] += 0.5
    base["students"]["distill_hybrid_95"]["psnr_per_clip"] = [20.0, 21.0, 9.0]
    variant["students"]["distill_hybrid_95"]["psnr_per_clip"] = [20.5, 20.0, 10.0]
    found = variant_comparison(base, variant)
    assert found["changed"] == {"train_shift": (None, 5.0)}
    assert [r["name"] for r in found["rows"]] == [n for n in base["students"] if n != "distill_topp_95"]
    text = variant_markdown(base, variant)
    assert "train_shift: null -> 5.0" in text
    assert "+0.50 dB, higher PSNR on 2/3 clips | +0.17 +- 0.60 dB |" in text  # differences 0.5, -1, 1

    variant["settings"].update(seed=1, data_seed=2)  # another draw of the training noise and data
    assert variant_comparison(base, variant)["changed"] == {"train_shift": (None, 5.0), "seed": (0, 1),
                                                            "data_seed": (1, 2)}

    variant["settings"]["fine_tuning"] = "slice"  # base, an older grid, fine-tuned on the slice without saying so
    assert "fine_tuning" not in variant_comparison(base, variant)["changed"]
    for edit, match in ((("settings", "guidance", 6.0), "judged differently \\(guidance\\)"),
                        (("dense", "heldout_loss", 0.5), "dense teacher")):
        _assert_refused(variant_comparison, base, variant, edit, match)
    with pytest.raises(ValueError, match="share no student"):
        variant_comparison(base, {**variant, "students": {}})
    # The same teacher evaluated on another GPU model (its held-out loss in the fourth digit), or not evaluated
    other_gpu = copy.deepcopy(variant)
    other_gpu["dense"]["heldout_loss"]["overall"] *= 1 + 5e-4
    assert variant_comparison(base, other_gpu)["rows"]
    assert variant_comparison(base, {**variant, "dense": None})["rows"]


def test_students_train_at_the_teachers_shift_unless_told(tmp_path):
    default = claims_grid.Grid(claims_grid.parse_args(["--out", str(tmp_path), "--part", "plan", *TINY]))
    teacher = default.teacher()
    teacher.config["training"] = {"arguments": {"train_shift": 2.0}}  # as the shipped model records it
    assert default.training_shift(teacher) == 2.0
    told = claims_grid.Grid(claims_grid.parse_args(["--out", str(tmp_path), "--part", "plan", "--train-shift", "5",
                                                    *TINY]))
    assert told.training_shift(teacher) == 5.0
    with pytest.raises(SystemExit):
        claims_grid.parse_args(["--out", str(tmp_path), "--part", "plan", "--train-shift", "0", *TINY])
    report = _grid()
    assert "time shift" not in grid_markdown(report)
    report["settings"]["train_shift"] = 5.0
    assert "noise levels drawn at time shift 5.0. Judged on" in grid_markdown(report)


def test_synthetic_arm_trains_on_the_teachers_own_samples_cached_by_the_library(tmp_path):
    """--fine-tune-on synthetic: --part cache writes the teacher's dense samples of the slice's captions through
    sparsevid.data.cache_synthetic (a latent shard folder with the caption states), and the students train on it."""
    import torch

    from sparsevid.training import STREAM_TEACHER, LatentDirectory, sample_generator
    from sparsevid_lab.data.sources import ProceduralSource
    from sparsevid_lab.model.pipeline import builtin_encoder

    args = ["--out", str(tmp_path), "--fine-tune-on", "synthetic", "--cache-batch", "2", "--objectives", "distill",
            *TINY]
    assert claims_grid.main([*args, "--part", "calibrate", "cache", "train"]) == 0
    grid = claims_grid.Grid(claims_grid.parse_args([*args, "--part", "plan"]))
    teacher = grid.teacher()
    data = LatentDirectory(tmp_path / "synthetic", seed=1)  # the data seed orders the folder as it did the clips
    index = json.loads((tmp_path / "synthetic" / "index.json").read_text())
    captions = ProceduralSource(grid.data_slice(teacher), seed=1, clips=2).captions(range(2))
    assert [s["caption"] for s in index["samples"]] == captions and index["settings"]["family"] == "builtin"
    assert data.latent_shape == teacher.clip_shape and data.text_shape[-1] == teacher.config["caption_encoder"]["dim"]
    encoder = builtin_encoder(teacher)
    alone = encoder.pipe(prompt=captions[1:], height=teacher.clip_shape[2], width=teacher.clip_shape[3],
                         num_frames=teacher.clip_shape[1], num_inference_steps=2,
                         guidance_scale=teacher.config["sampling"]["guidance"], output_type="latent",
                         generator=[sample_generator(1, 1, STREAM_TEACHER)]).frames
    row = next(i for i in range(2) if data.sample(i) == 1)
    assert torch.allclose(data.batch([row]).latents, alone, atol=1e-4)  # batch of 2 vs alone: float32 arithmetic
    trained = json.loads((tmp_path / "students" / "distill_hybrid_75" / "eval.json").read_text())["training"]
    assert trained["data"] == data.describe()  # the students read the shard folder


def test_teacher_samples_can_be_drawn_with_their_own_sampler_settings(tmp_path):
    """--cache-steps / --cache-guidance set the sampler of --part cache apart from the evaluation's (which they
    default to), and the grid's settings record them."""
    import torch

    from sparsevid.training import STREAM_TEACHER, LatentDirectory, sample_generator
    from sparsevid_lab.model.pipeline import builtin_encoder

    args = ["--out", str(tmp_path), "--fine-tune-on", "synthetic", "--cache-batch", "2", "--objectives", "distill",
            *TINY]
    plain = claims_grid.parse_args([*args, "--part", "plan"])
    grid = claims_grid.Grid(plain)
    teacher = grid.teacher()
    assert claims_grid.synthetic_sampling(plain, teacher) == {"steps": 2,
                                                              "guidance": teacher.config["sampling"]["guidance"]}
    own = [*args, "--cache-steps", "3", "--cache-guidance", "1.0"]
    assert claims_grid.synthetic_sampling(claims_grid.parse_args([*own, "--part", "plan"]), teacher) == {
        "steps": 3, "guidance": 1.0}
    assert claims_grid.main([*own, "--part", "calibrate", "cache", "train", "report"]) == 0
    data = LatentDirectory(tmp_path / "synthetic", seed=1)
    captions = [s["caption"] for s in json.loads((tmp_path / "synthetic" / "index.json").read_text())["samples"]]
    alone = builtin_encoder(teacher).pipe(
        prompt=captions[1:], height=teacher.clip_shape[2], width=teacher.clip_shape[3],
        num_frames=teacher.clip_shape[1], num_inference_steps=3, guidance_scale=1.0, output_type="latent",
        generator=[sample_generator(1, 1, STREAM_TEACHER)]).frames
    row = next(i for i in range(2) if data.sample(i) == 1)
    assert torch.allclose(data.batch([row]).latents, alone, atol=1e-4)  # batch of 2 vs alone: float32 arithmetic
    settings = json.loads((tmp_path / "grid.json").read_text())["settings"]
    assert settings["synthetic_sampling"] == {"steps": 3, "guidance": 1.0}
    for bad, match in ((["--cache-steps", "0"], "--cache-steps"), (["--cache-guidance", "-1"], "--cache-guidance")):
        with pytest.raises(SystemExit):
            claims_grid.parse_args([*args, *bad, "--part", "plan"])
