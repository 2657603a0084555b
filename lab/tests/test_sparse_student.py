"""Students of the built-in model in sparsevid's student format: written by the training path, loaded in one call
over the dense weights they were fine-tuned from, refused over others; the lab's distill and eval arguments."""
import json

import pytest
import torch

pytest.importorskip("diffusers")

import sparsevid as sv  # noqa: E402
from sparsevid.training import STUDENT_CONFIG, STUDENT_WEIGHTS, DistillConfig, LoopConfig, distill  # noqa: E402
from sparsevid_lab.data.sources import ProceduralSource  # noqa: E402
from sparsevid_lab.model.builtin import (BuiltinVideoDiT, CaptionedClips, export_builtin, load_builtin,  # noqa: E402
                                         tiny_config)
from sparsevid_lab.model.sparse_student import load_sparse_student  # noqa: E402

SPARSE = sv.SparseConfig(rule="hybrid", topk=0.25, topp=0.5, block_q=64, block_k=64)


def _tiny():
    torch.manual_seed(0)
    return BuiltinVideoDiT(tiny_config())


def _quiet(line):
    pass


def _distill_run(tmp_path, **config):
    """A dense base written to tmp_path/base and a 2-step attention-only student of it in tmp_path/base/student."""
    base = tmp_path / "base"
    export_builtin(_tiny(), base, dtype=torch.bfloat16)
    model = load_builtin(base)
    config = DistillConfig(**{"sparse": SPARSE, "trainable": "attention", "batch_size": 2, **config})
    loop = LoopConfig(lr=1e-2, warmup_steps=0, max_steps=2, ema_decay=None, log_every=1)
    distill(model.transformer, CaptionedClips(model, ProceduralSource(model.data, seed=1)), config, loop,
            out=base / "student", log=_quiet)
    return base, base / "student", model


def test_a_student_loads_in_one_call_as_the_trained_sparse_model(tmp_path):
    base, student, trained = _distill_run(tmp_path)
    record = json.loads((student / STUDENT_CONFIG).read_text())
    assert record["trainable"] == "attention" and record["steps"] == 2
    assert (student / STUDENT_WEIGHTS).stat().st_size < (base / "builtin.safetensors").stat().st_size / 2

    loaded, config = load_sparse_student(student)  # the dense weights come from the folder holding the student
    assert config == SPARSE and sv.is_sparse(loaded.transformer)
    dense = load_builtin(base).state_dict()
    attention = {f"transformer.{n}" for n in sv.training.trainable_names(loaded.transformer, "attention")}
    assert attention and len(attention) < len(dense)
    moved = 0
    for name, value in loaded.state_dict().items():
        if name in attention:  # the student's tensors, rounded to the student file's bf16
            assert torch.equal(value, trained.state_dict()[name].to(torch.bfloat16).float()), name
            moved += not torch.equal(value, dense[name])
        else:
            assert torch.equal(value, dense[name]), name
    assert moved > 0  # training changed the attention weights, and the student file carries the change

    # same velocity as the trained student (its weights rounded as the file stores them), through its masks
    for name, value in trained.state_dict().items():
        value.copy_(value.to(torch.bfloat16).float())
    x, t = torch.randn(2, *loaded.clip_shape), torch.tensor([0.3, 0.8])
    tokens = loaded.tokenize(["big red plain circle moving left on a navy background", ""])
    sv.reset_denoising_step(loaded.transformer)
    sv.reset_denoising_step(trained.transformer)
    with torch.no_grad():
        assert torch.allclose(loaded(x, t, tokens), trained(x, t, tokens), rtol=0, atol=1e-5)
        sv.remove_sparse_attention(loaded.transformer)
        assert not torch.allclose(loaded(x, t, tokens), trained(x, t, tokens), atol=1e-3)  # the masks matter


def test_a_student_refuses_other_base_weights(tmp_path):
    base, student, _ = _distill_run(tmp_path)
    other = tmp_path / "other"
    export_builtin(BuiltinVideoDiT(tiny_config()), other, dtype=torch.bfloat16)  # other random weights
    with pytest.raises(ValueError, match="not the base the student"):
        load_sparse_student(student, base=other)
    with pytest.raises(FileNotFoundError, match="student folder"):
        load_sparse_student(tmp_path / "nothing", base=base)
    for dtype in (torch.complex64, "float16"):
        with pytest.raises(TypeError, match="dtype must be a floating-point torch.dtype"):
            load_sparse_student(student, dtype=dtype)


@pytest.mark.parametrize("argv, message", [
    (["--backgrounds", "purple"], "unknown: purple"),
    (["--motions", "moving sideways"], "unknown: moving sideways"),
    (["--data", "dir", "--data-dir", ".", "--colours", "red"], "need --data procedural"),
], ids=["background", "motion", "slice-of-files"])
def test_distill_rejects_bad_slices_in_one_line(tmp_path, capsys, argv, message):
    from sparsevid_lab.cli import main

    try:  # an argument's type fails in parsing (SystemExit), a later check returns the status
        code = main(["distill", "--out", str(tmp_path), "--tiny", "--max-steps", "1", *argv])
    except SystemExit as error:
        code = error.code
    assert code == 2 and message in capsys.readouterr().err


def test_a_call_stopped_early_resumes_to_the_uninterrupted_run(tmp_path):
    from sparsevid.training import train_loop

    def run(loop, state, resume=False, stop_after=None):
        torch.manual_seed(0)
        module = torch.nn.Linear(4, 1)
        if resume:
            module.weight.data.zero_()  # restored from the state file below
        data = torch.randn(64, 4, generator=torch.Generator().manual_seed(1))

        def loss_fn(step):
            if stop_after is not None and step + 1 >= stop_after:
                loop.stop_at = 0.0  # the clock runs out: no step after this one
            return module(data[step * 8:(step + 1) * 8]).pow(2).mean()

        return module, train_loop(module, loss_fn, loop, state_path=state, resume=resume, log=_quiet)

    def config():
        return LoopConfig(lr=0.1, warmup_steps=1, max_steps=6, ema_decay=None, log_every=1, checkpoint_every=100)

    whole, whole_result = run(config(), tmp_path / "whole.safetensors")
    _, cut = run(config(), tmp_path / "cut.safetensors", stop_after=2)
    assert not cut.finished and cut.steps == 2 and whole_result.finished
    resumed, rest = run(config(), tmp_path / "cut.safetensors", resume=True)
    assert rest.finished and rest.steps == 6
    assert torch.equal(resumed.weight, whole.weight) and torch.equal(resumed.bias, whole.bias)
    assert [r["lr"] for r in rest.history] == [r["lr"] for r in whole_result.history][-len(rest.history):]


def test_eval_held_out_captions_come_from_outside_the_slice(tmp_path):
    from sparsevid_lab.cli import main
    from sparsevid_lab.data import ProceduralVideos

    out = tmp_path / "eval"
    assert main(["eval", "--tiny", "--held-out", "2", "--backgrounds", "navy", "--max-objects", "1", "--steps", "1",
                 "--config", "rule=topk,topk=0.5", "--heldout-per-bin", "1", "--noise-bins", "1",
                 "--oracle-sparsity", "0.5", "--out", str(out)]) == 0
    captions = json.loads((out / "results.json").read_text())["settings"]["captions"]
    narrow = ProceduralVideos(frames=4, height=32, width=32, max_objects=1, backgrounds=["navy"])
    assert len(captions) == 2 and not any(narrow.fits(c) for c in captions)
    assert main(["eval", "--tiny", "--backgrounds", "navy", "--out", str(out)]) == 2  # a slice without --held-out


def test_the_shipped_students_load_on_the_shipped_weights():
    """The demo's student (75%, fine-tuned at the CPU clip) and the best 95% student of the claims grid (long
    clip) both load in one call over the shipped dense weights, each with its own sparse setting."""
    from sparsevid_lab.model.builtin import ASSETS

    model, _ = load_sparse_student()
    assert sv.is_sparse(model.transformer)
    dense = load_builtin().state_dict()
    for folder, topk in ((ASSETS / "sparse_student", 0.25), (ASSETS / "sparse_student_95", 0.05)):
        model, config = load_sparse_student(folder, apply=False)
        assert (config.rule, config.topk) == ("topk", topk) and not sv.is_sparse(model.transformer)
        changed = [n for n, t in model.state_dict().items() if not torch.equal(t, dense[n])]
        assert changed and all(".attn1." in n for n in changed)  # only the self-attention was fine-tuned
