"""The demo command end to end on the tiny configuration."""
import json

import numpy as np

import pytest

from sparsevid_lab.cli import main


def test_demo_runs_and_writes_its_files(tmp_path, capsys):
    assert main(["demo", "--tiny", "--out", str(tmp_path), "--steps", "2", "--rule", "topk", "--topk", "0.25"]) == 0
    printed = capsys.readouterr().out
    assert "sparsity" in printed and "PSNR" in printed and "SSIM" in printed and "attention s" in printed
    for name in ("dense_vs_sparse.gif", "dense_vs_sparse.png", "demo.json"):
        assert (tmp_path / name).stat().st_size > 0, name
    summary = json.loads((tmp_path / "demo.json").read_text())
    # the tiny model's dense generation is fast: --noise-floor auto measures the noise floor
    assert list(summary["runs"]) == ["dense", "training-free top-k 0.25", "noise floor"]
    dense, sparse, floor = summary["runs"].values()
    assert sparse["sparsity"] == pytest.approx(0.75)  # one of four key blocks per query block
    assert dense["sparsity"] == 0.0 and dense["speedup"] == 1.0 and dense["ssim"] == pytest.approx(1.0)
    assert sparse["seconds"] > 0 and sparse["attention_s"] > 0
    assert sparse["speedup"] == pytest.approx(dense["seconds"] / sparse["seconds"])
    assert all(0 <= run["faithfulness"] <= 1 for run in (dense, sparse)) and "faithful" in printed
    assert floor["sparsity"] == 0.0 and floor["config"]["topk"] == 1.0 and floor["psnr"] > 60
    assert f"noise floor {floor['psnr']:.2f} dB" in printed and "measured in this run" in printed
    assert "What the numbers mean" in printed
    assert summary["settings"]["steps"] == 2


def test_demo_student_column_and_noise_floor_reuse(tmp_path, capsys, monkeypatch):
    """--student adds the student's clip under its own sparse setting; without a measured noise floor the
    printout says so, and a later run with the same settings reuses an earlier measured one."""
    import torch

    import sparsevid as sv
    from sparsevid_lab.cli import demo
    from sparsevid.training import base_fingerprint, save_student
    from sparsevid_lab.model.builtin import BuiltinVideoDiT, tiny_config

    torch.manual_seed(0)
    base = BuiltinVideoDiT(tiny_config())  # what --tiny builds
    torch.manual_seed(1)
    student_dir = save_student(BuiltinVideoDiT(tiny_config()).transformer, tmp_path / "student",
                               sv.SparseConfig(rule="topk", topk=0.5), "all", base_fingerprint(base.transformer, "all"))
    out = tmp_path / "demo"
    common = ["demo", "--tiny", "--out", str(out), "--steps", "2", "--student", str(student_dir)]
    assert main(common + ["--noise-floor", "off"]) == 0
    printed = capsys.readouterr().out
    summary = json.loads((out / "demo.json").read_text())
    assert list(summary["runs"]) == ["dense", "training-free top-k 0.25", "sparse student"]
    student = summary["runs"]["sparse student"]
    assert student["sparsity"] == pytest.approx(0.5) and student["config"]["topk"] == 0.5
    assert 0 < student["psnr"] < 60  # other weights (seed 1) than the tiny dense model (seed 0)
    assert "noise floor not measured" in printed and "--noise-floor on" in printed

    assert main(common + ["--noise-floor", "on"]) == 0
    measured = json.loads((out / "demo.json").read_text())["runs"]["noise floor"]
    assert "measured in this run" in capsys.readouterr().out
    monkeypatch.setattr(demo, "AUTO_NOISE_FLOOR_S", 0.0)  # auto now skips measuring: as on a slow machine
    assert main(common) == 0
    printed = capsys.readouterr().out
    assert f"noise floor {measured['psnr']:.2f} dB" in printed and "reused from the run of" in printed
    assert json.loads((out / "demo.json").read_text())["runs"]["noise floor"]["psnr"] == measured["psnr"]
    assert main(common + ["--seed", "3"]) == 0  # other noise: the earlier floor does not apply
    assert "noise floor not measured" in capsys.readouterr().out


def ink(image: np.ndarray) -> np.ndarray:
    """Where ``image`` [H, W, 3 or 4] is dark (text on white): bool [H, W]."""
    return image[..., :3].min(axis=-1) < 128


def text_lines(dark: np.ndarray) -> int:
    """How many separate bands of rows of the bool mask ``dark`` [H, W] hold dark pixels: its lines of text."""
    inked = dark.any(axis=1).astype(int)
    return int(inked[0] + (np.diff(inked) == 1).sum())


def test_clip_header_names_each_clip_and_fits_the_caption():
    """The header band is white with dark text over each clip and one caption wider than the clips wraps."""
    from sparsevid_lab.eval.media import header

    band = header(300, 149, 2, labels=["dense", "sparse hybrid 90%"], caption="big red plain circle " * 6)
    assert band.dtype == np.uint8 and band.shape[1] == 300 and band.shape[0] > 30  # caption lines + labels
    dark = ink(band)
    label_row = dark[-20:]  # the last line holds the labels, one over each clip
    assert label_row[:, :149].any() and label_row[:, 151:].any()
    assert dark.any(axis=1).sum() > 20 and (band[0] == 255).all()


def test_clip_header_grows_to_hold_a_note_and_labels_of_several_lines():
    """A note under the caption and labels of several lines (setting, sparsity, PSNR / SSIM) each add lines of
    text to the band; each clip's lines stay over that clip, right of ``left`` (a frame margin)."""
    from sparsevid_lab.eval.media import header

    labels = ["dense (all tiles)\nthe reference",
              "top-k 0.25\n75% of attention tiles skipped\nPSNR 15.07 dB, SSIM 0.6354"]
    geometry = dict(width=540, clip_width=220, gap=8, left=90, caption="a caption")
    note = "PSNR / SSIM vs the dense clip; noise floor 115.63 dB"
    plain = header(**geometry, labels=["dense", "top-k 0.25"])
    top = header(**geometry, note=note)
    full = header(**geometry, labels=labels, note=note)
    assert full.shape[1] == plain.shape[1] == 540 and full.shape[0] > top.shape[0] and full.shape[0] > plain.shape[0]
    assert text_lines(ink(plain)) == 2 and text_lines(ink(top)) == 2 and text_lines(ink(full)) == 5
    assert (full[:top.shape[0] - 4] == top[:top.shape[0] - 4]).all()  # the caption and note as without labels
    below = ink(full[top.shape[0] - 4:])  # the labels only
    assert not below[:, :90].any() and not below[:, 310:318].any()  # none over the margin or the gap
    assert text_lines(below[:, 90:310]) == 2 and text_lines(below[:, 318:]) == 3


def test_frame_margin_names_each_row():
    """The margin beside a strip of frames has dark text in the middle of each row's band and white edges."""
    from sparsevid_lab.eval.media import frame_margin

    margin = frame_margin([1, 3, 5, 15], 64)
    assert margin.dtype == np.uint8 and margin.shape[0] == 4 * 64 and 40 < margin.shape[1] < 120
    dark = ink(margin)
    for row in range(4):
        band = dark[row * 64:(row + 1) * 64]
        rows = np.flatnonzero(band.any(axis=1))
        assert rows.size and 20 < rows.mean() < 44, row  # text, centred in its band
        assert not band[:8].any() and not band[-8:].any()
    assert (dark.any(axis=0).nonzero()[0].max() > margin.shape[1] - 12)  # right-aligned next to the clips


def test_write_clips_labels_rows_and_columns(tmp_path):
    """With frame labels the strip and every GIF frame carry the margin left of the clips, one label per row of
    the strip, under a header whose labels sit over the clips."""
    import imageio.v2 as imageio
    import torch

    from sparsevid_lab.eval.media import write_clips

    videos = [torch.zeros(3, 6, 16, 16), torch.ones(3, 6, 16, 16)]  # grey and white clips of six frames
    write_clips(videos, tmp_path / "bare", scale=2)
    write_clips(videos, tmp_path / "named", scale=2, labels=["dense", "sparse\n75%"],
                caption="a caption", note="a note", frame_labels=True)
    bare, strip = (imageio.imread(tmp_path / f"{name}.png")[..., :3] for name in ("bare", "named"))
    assert bare.shape == (3 * 32, 2 * 32 + 4, 3)  # frames 1, 3, 5; no margin, no header
    width, top = strip.shape[1] - bare.shape[1], strip.shape[0] - bare.shape[0]
    assert width > 30 and top > 40
    assert (strip[top:, width:] == bare).all()  # the clips, unchanged, right of the margin under the header
    margin = ink(strip[top:, :width])
    assert all(margin[row * 32:(row + 1) * 32].any() for row in range(3))
    assert text_lines(ink(strip[:top])) == 4  # caption, note, two label lines
    gif = imageio.mimread(tmp_path / "named.gif")
    assert len(gif) == 6 and all(frame.shape[:2] == (top + 32, strip.shape[1]) for frame in gif)
    assert all(ink(frame[top:, :width]).any() for frame in gif)


def test_demo_picture_labels_say_what_the_numbers_mean(tmp_path, monkeypatch):
    """The demo hands the picture writer labels with the share of tiles skipped and PSNR / SSIM against the
    dense clip, the noise floor (or that it was not measured) and frame labels."""
    from sparsevid_lab.cli import demo
    from sparsevid_lab.eval import media

    calls = []
    write = media.write_clips
    monkeypatch.setattr(media, "write_clips", lambda *a, **k: calls.append(k) or write(*a, **k))
    for floor in ("on", "off"):
        assert main(["demo", "--tiny", "--out", str(tmp_path), "--steps", "2", "--noise-floor", floor]) == 0
    runs = json.loads((tmp_path / "demo.json").read_text())["runs"]
    measured, skipped = calls
    sparse = runs["training-free top-k 0.25"]
    assert measured["labels"][0].startswith("dense (all tiles)") and measured["frame_labels"]
    assert measured["labels"][1].split("\n") == [
        "training-free top-k 0.25", "75% of attention tiles skipped",
        f"PSNR {sparse['psnr']:.2f} dB, SSIM {sparse['ssim']:.4f}"]
    assert "noise floor" in measured["note"] and " dB / 1.0000 = dense through the sparse path" in measured["note"]
    assert skipped["note"].endswith("noise floor not measured") and demo.DEFAULT_CAPTION in skipped["caption"]


def test_eval_command_writes_table_json_and_plots(tmp_path, capsys):
    assert main(["eval", "--tiny", "--out", str(tmp_path), "--steps", "2", "--captions", "1", "--heldout-per-bin", "1",
                 "--noise-bins", "3", "--oracle-sparsity", "0.5", "0.75", "--probe-steps", "1",
                 "--config", "rule=topk,topk=1,tile=none", "--config", "rule=topk,topk=1.0"]) == 0
    assert "smoke test" in capsys.readouterr().out
    results = json.loads((tmp_path / "results.json").read_text())
    assert set(results["configs"]) == {"rule=topk,topk=1,tile=none", "rule=topk,topk=1.0"}
    assert results["configs"]["rule=topk,topk=1.0"]["sparsity"] == 0.0
    assert results["settings"]["smoke_test"] is True
    assert results["noise_floor_psnr"] > 60 and results["noise_floor_ssim"] == pytest.approx(1.0, abs=1e-6)
    for entry in [results["dense"], results["noise_floor"], *results["configs"].values()]:
        assert {"faithfulness", "velocity_error", "heldout_loss"} <= set(entry)
        assert len(entry["velocity_error"]["per_bin"]) == 3 and len(entry["heldout_loss"]["per_bin"]) == 3
    assert results["dense"]["velocity_error"]["overall"] == 0.0
    assert results["configs"]["rule=topk,topk=1,tile=none"]["velocity_error"]["overall"] > 1e-3
    assert results["oracle"]["sparsities"] == [0.5, 0.75]
    one = results["configs"]["rule=topk,topk=1,tile=none"]
    assert one["predicted_recall"] <= one["oracle_recall"] + 1e-9
    table = (tmp_path / "results.md").read_text()
    assert all(0 <= entry["faithfulness"]["overall"] <= 1 and "motion" in entry["faithfulness"]["per_attribute"]
               for entry in [results["dense"], results["noise_floor"], *results["configs"].values()])
    assert "Smoke test" in table and "| setting | sparsity | PSNR (dB) | SSIM | faithfulness | velocity error |" in table
    assert "Caption faithfulness per attribute" in table
    assert "every tile kept (noise floor)" in table
    for name in ("first_clip.gif", "quality_vs_sparsity.png", "recall_vs_sparsity.png", "recall_per_layer.png"):
        assert (tmp_path / name).stat().st_size > 0, name


@pytest.mark.parametrize("argv, message", [(["--topp", "1.5"], "--topp"), (["--student", "no/such/dir"], "--student"),
                                           (["--noise-floor", "sometimes"], "--noise-floor")])
def test_demo_rejects_bad_arguments(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--tiny", "--out", str(tmp_path)] + argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_demo_student_needs_its_sparse_config(tmp_path, capsys):
    from sparsevid_lab.model.builtin import BuiltinVideoDiT, export_builtin, tiny_config

    export_builtin(BuiltinVideoDiT(tiny_config()), tmp_path / "model")  # a model directory, not a student
    with pytest.raises(SystemExit):
        main(["demo", "--tiny", "--out", str(tmp_path), "--student", str(tmp_path / "model")])
    assert "is not a student folder" in capsys.readouterr().err


def test_demo_runs_the_student_shipped_beside_the_model(tmp_path, capsys):
    """--student auto (the default) finds the asset in the model's sparse_student folder; 'none' leaves the
    column out; an asset fine-tuned from other weights is refused with a clear error."""
    import torch

    import sparsevid as sv
    from sparsevid.training import base_fingerprint, save_student
    from sparsevid_lab.cli.students import read_student_like
    from sparsevid_lab.model.builtin import BuiltinVideoDiT, export_builtin, load_builtin, tiny_config

    torch.manual_seed(0)
    base = export_builtin(BuiltinVideoDiT(tiny_config()), tmp_path / "model", dtype=torch.float32).parent
    student = load_builtin(base)
    fingerprint = base_fingerprint(student.transformer, "attention")
    with torch.no_grad():
        for name, tensor in student.transformer.named_parameters():
            if ".attn1." in name:
                tensor.add_(0.01)  # "fine-tuned" self-attention
    save_student(student.transformer, base / "sparse_student", sv.SparseConfig(rule="topk", topk=0.5), "attention",
                 fingerprint)
    reference = load_builtin(base)
    reference.use_clip(2, 16, 16)  # as --clip does: the student must sample the reference's clip shape
    reference.config["sampling"]["steps"] = 3  # as the CPU defaults do: and with the reference's sampler steps
    like, config = read_student_like(base / "sparse_student", reference)
    assert like.clip_shape == reference.clip_shape == (3, 2, 16, 16) and config.topk == 0.5
    assert like.config["sampling"] == reference.config["sampling"]
    out = tmp_path / "demo"
    common = ["demo", "--model", str(base), "--out", str(out), "--steps", "2", "--noise-floor", "off"]
    assert main(common) == 0
    summary = json.loads((out / "demo.json").read_text())
    assert list(summary["runs"]) == ["dense", "training-free top-k 0.25", "sparse student"]
    assert summary["settings"]["student"] == str(base / "sparse_student")
    assert summary["runs"]["sparse student"]["sparsity"] == pytest.approx(0.5)
    assert 0 < summary["runs"]["sparse student"]["psnr"] < 60  # its attention weights differ from the base's

    assert main(common + ["--student", "none"]) == 0
    assert list(json.loads((out / "demo.json").read_text())["runs"]) == ["dense", "training-free top-k 0.25"]

    torch.manual_seed(1)
    other = export_builtin(BuiltinVideoDiT(tiny_config()), tmp_path / "other", dtype=torch.float32).parent
    capsys.readouterr()
    code = main(["demo", "--model", str(other), "--out", str(out), "--steps", "2",
                 "--student", str(base / "sparse_student")])
    error = capsys.readouterr().err
    assert code == 2 and "--student" in error and "not the base the student" in error
