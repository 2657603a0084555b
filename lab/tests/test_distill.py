"""The built-in model through the library's training path (velocity distillation): objective, data, resumable loop,
data parallel, the lab's CLI."""
import copy
import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("diffusers")

import sparsevid as sv  # noqa: E402
from sparsevid.training import (DenseTeacher, DistillConfig, LoopConfig, distill, load_training_state,  # noqa: E402
                                noisy, predict_velocity, save_training_state, trainable_names)
from sparsevid.training.distill import Draws  # noqa: E402
from sparsevid_lab.data.clipfiles import read_clip, write_clip  # noqa: E402
from sparsevid_lab.data.sources import DirectorySource, ProceduralSource  # noqa: E402
from sparsevid_lab.data.teacher_cache import teacher_cache  # noqa: E402
from sparsevid_lab.model.builtin import BuiltinVideoDiT, CaptionedClips, tiny_config  # noqa: E402

SPARSE = sv.SparseConfig(rule="topk", topk=0.25, block_q=64, block_k=64)  # 1 of 4 key blocks per row


def _tiny(seed=0):
    torch.manual_seed(seed)
    return BuiltinVideoDiT(tiny_config())


def _rows(out):
    return [json.loads(line) for line in (Path(out) / "log.jsonl").read_text().splitlines()]


def _loop(steps, **kw):
    return LoopConfig(**{"lr": 1e-3, "warmup_steps": 1, "max_steps": steps, "log_every": 100,
                         "checkpoint_every": 100, **kw})


def _quiet(line):
    pass


def _distill(model, clips, config, loop, **kwargs):
    """The library's distill on the built-in model's transformer, its caption encoder making the text states."""
    return distill(model.transformer, CaptionedClips(model, clips), config, loop, log=_quiet, **kwargs)


def _draws(model, clips, config, rank=0, world_size=1):
    return Draws(CaptionedClips(model, clips), config, rank, world_size, "cpu")


def test_distillation_reduces_the_loss(tmp_path):
    model = _tiny()
    with torch.no_grad():  # a model whose velocity leans on self-attention, so sparsity matters
        model.transformer.blocks[0].attn1.to_out[0].weight.mul_(8.0)
    teacher = DenseTeacher(copy.deepcopy(model.transformer).eval(), [])
    source = ProceduralSource(model.data, seed=3)
    config = DistillConfig(sparse=SPARSE, batch_size=4, null_prob=0.0)
    batch, t, noise = _draws(model, source, DistillConfig(batch_size=16))(10_000)
    x_t = noisy(batch.latents, noise, t)

    def held_out_loss():
        with torch.no_grad():
            sv.reset_denoising_step(model.transformer)
            student = predict_velocity(model.transformer, x_t, t, batch)
            return float(torch.nn.functional.mse_loss(student, teacher(x_t, t, batch)))

    sv.apply_sparse_attention(model.transformer, SPARSE)
    before = held_out_loss()
    sv.remove_sparse_attention(model.transformer)
    result = _distill(model, source, config, _loop(12, lr=3e-4), out=tmp_path)
    after = held_out_loss()
    assert result.steps == 12 and sv.is_sparse(model.transformer)
    assert before > 1e-3 and after < 0.95 * before, (before, after)


def test_everything_kept_matches_the_teacher_at_step_0(tmp_path):
    model = _tiny()
    source = ProceduralSource(model.data, seed=0)
    config = DistillConfig(sparse=sv.SparseConfig(rule="topk", topk=1.0, block_q=64, block_k=64), batch_size=4)
    batch, t, noise = _draws(model, source, config)(0)
    with torch.no_grad():
        scale = float(predict_velocity(model.transformer, noisy(batch.latents, noise, t), t, batch).square().mean())
    _distill(model, source, config, _loop(1), out=tmp_path)
    loss = _rows(tmp_path)[0]["loss"]
    # fp32 rounding: relative velocity error ~1e-6, so the relative squared error stays far below 1e-10
    assert loss < 1e-10 * scale, (loss, scale)


class CrashingSource(ProceduralSource):
    """Procedural clips that fail once when sample ``crash_at`` is read (a killed job)."""

    def __init__(self, data, seed, crash_at):
        super().__init__(data, seed)
        self.crash_at = crash_at

    def clips(self, indices, device="cpu"):
        if self.crash_at in indices:
            self.crash_at = None
            raise KeyboardInterrupt("killed")
        return super().clips(indices, device)


def test_resume_after_a_kill_continues_identically(tmp_path):
    config = DistillConfig(sparse=SPARSE, batch_size=2)
    loop = _loop(6, ema_decay=0.9, checkpoint_every=2)
    whole = _tiny()
    _distill(whole, ProceduralSource(whole.data, 5), config, loop, out=tmp_path / "whole")

    killed = _tiny()
    with pytest.raises(KeyboardInterrupt):  # dies in step 5, after the step-4 checkpoint and step-4 log row
        _distill(killed, CrashingSource(killed.data, 5, crash_at=8), config, loop, out=tmp_path / "kill")
    assert [r["step"] for r in _rows(tmp_path / "kill")] == [1, 2, 3, 4]
    (tmp_path / "kill" / "log.jsonl").open("a").write(json.dumps({"step": 5, "loss": 1.0}) + "\n")  # a lost step
    resumed = _tiny()  # the pretrained model again (the teacher); the student's progress comes from the state
    _distill(resumed, ProceduralSource(resumed.data, 5), config, loop, out=tmp_path / "kill", resume=True)
    drop = ("seconds",)
    assert [{k: v for k, v in r.items() if k not in drop} for r in _rows(tmp_path / "kill")] == \
           [{k: v for k, v in r.items() if k not in drop} for r in _rows(tmp_path / "whole")]
    for (name, a), b in zip(whole.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name
    with pytest.raises(ValueError, match="different settings.*batch_size"):
        other = _tiny()
        _distill(other, ProceduralSource(other.data, 5), DistillConfig(sparse=SPARSE, batch_size=4), _loop(8),
                 out=tmp_path / "kill", resume=True)


def test_training_state_restores_the_rng(tmp_path):
    layer = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(layer.parameters())
    save_training_state(tmp_path / "s.safetensors", layer, {}, optimizer, 3, {"run": {"a": 1}})
    expected = torch.rand(4)
    torch.rand(7)
    step, info = load_training_state(tmp_path / "s.safetensors", layer, {}, optimizer)
    assert step == 3 and info == {"run": {"a": 1}} and torch.equal(torch.rand(4), expected)


def test_gradient_checkpointing_and_attention_only(tmp_path):
    runs = []
    for checkpointing in (False, True):
        model = _tiny()
        config = DistillConfig(sparse=SPARSE, batch_size=2, trainable="attention",
                               gradient_checkpointing=checkpointing)
        initial = copy.deepcopy(model.state_dict())
        result = _distill(model, ProceduralSource(model.data, 2), config, _loop(2), out=tmp_path / str(checkpointing))
        changed = {name for name, value in model.state_dict().items() if not torch.equal(value, initial[name])}
        assert changed and all(".attn1." in name for name in changed), sorted(changed)
        assert result.trainable_parameters < sum(p.numel() for p in model.parameters())
        runs.append([r["loss"] for r in _rows(tmp_path / str(checkpointing))])
    assert runs[0] == pytest.approx(runs[1], rel=1e-6)


def test_diffusion_baseline_cli_writes_a_loadable_student(tmp_path):
    from sparsevid_lab.cli import main

    out = tmp_path / "run"
    assert main(["distill", "--out", str(out), "--tiny", "--objective", "diffusion", "--max-steps", "2",
                 "--batch-size", "2", "--config", "rule=hybrid,topk=0.25,topp=0.5,block_q=64,block_k=64",
                 "--no-progress"]) == 0
    rows = _rows(out)
    assert [r["step"] for r in rows] == [1, 2] and all(0.05 < r["loss"] < 10 for r in rows)  # data-scale MSE
    record = json.loads((out / "student.json").read_text())
    assert record["objective"] == "diffusion" and record["trainable"] == "attention"
    base = _tiny()  # what --tiny fine-tuned
    config = sv.load_student(base.transformer, out)
    assert (config.rule, config.topk, config.topp) == ("hybrid", 0.25, 0.5) and sv.is_sparse(base.transformer)
    assert (out / "loss.png").stat().st_size > 0

    compared = tmp_path / "compare"
    assert main(["compare", "--tiny", "--student", f"baseline={out}", "--training-free",
                 "rule=topk,topk=1.0,block_q=64,block_k=64", "--captions", "1", "--steps", "2",
                 "--out", str(compared)]) == 0
    written = json.loads((compared / "results.json").read_text())
    assert written["settings"]["steps"] == 2 and len(written["settings"]["captions"]) == 1  # what was sampled
    results = written["candidates"]
    assert results["training-free rule=topk,topk=1.0,block_q=64,block_k=64"]["psnr"] > 60  # all kept: ~dense
    assert 10 < results["baseline"]["psnr"] < 60  # two steps of training changed the model
    assert results["training-free rule=topk,topk=1.0,block_q=64,block_k=64"]["sparsity"] == 0.0
    assert 0 < results["baseline"]["sparsity"] < 1  # its own hybrid 0.25 / 0.5 setting skips tiles
    assert "| sparsity |" in (compared / "results.md").read_text()
    with pytest.raises(SystemExit):  # not LABEL=DIR (lab/tests/test_cli.py checks the message)
        main(["compare", "--tiny", "--student", str(out)])


def test_two_processes_match_one(tmp_path, torchrun):
    args = ["distill", "--tiny", "--max-steps", "3", "--batch-size", "4", "--lr", "1e-3", "--warmup", "1",
            "--config", "rule=hybrid,topk=0.25,topp=0.5,block_q=64,block_k=64", "--no-progress", "--data-seed", "4"]
    from sparsevid_lab.cli import main

    assert main([*args, "--out", str(tmp_path / "one")]) == 0
    done = torchrun(["-m", "sparsevid_lab", *args, "--out", str(tmp_path / "two")], cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "over 2 process(es)" in done.stdout
    one, two = _rows(tmp_path / "one"), _rows(tmp_path / "two")
    assert [r["step"] for r in two] == [1, 2, 3]
    assert [r["loss"] for r in two] == pytest.approx([r["loss"] for r in one], rel=1e-5)
    assert [r["grad_norm"] for r in two] == pytest.approx([r["grad_norm"] for r in one], rel=1e-5)
    assert one[-1]["loss"] != one[0]["loss"]


def test_ranks_draw_disjoint_samples_of_the_global_batch():
    model = _tiny()
    source = ProceduralSource(model.data, 0)
    config = DistillConfig(batch_size=4)
    ranks = [_draws(model, source, config, r, 2) for r in range(2)]
    assert ranks[0].indices(3) == [12, 13] and ranks[1].indices(3) == [14, 15]
    whole = _draws(model, source, config)(3)
    halves = [b(3) for b in ranks]
    for part in (lambda d: d[0].latents, lambda d: d[0].text, lambda d: d[1], lambda d: d[2]):
        assert torch.equal(part(whole), torch.cat([part(halves[0]), part(halves[1])]))
    with pytest.raises(ValueError, match="batch_size"):
        _draws(model, source, DistillConfig(batch_size=3), 0, 2)


def test_procedural_source_is_keyed_by_sample_index():
    data = _tiny().data
    source = ProceduralSource(data, seed=1)
    both, captions = source.clips([3, 4])
    three, four = source.clips([3])[0], source.clips([4])[0]
    assert torch.equal(both, torch.cat([three, four])) and captions == source.captions([3, 4])
    assert not torch.equal(three, ProceduralSource(data, seed=2).clips([3])[0])


def test_clip_files_and_directory_source(tmp_path):
    clips = [torch.randn(3, 4, 8, 8) for _ in range(3)]
    write_clip(tmp_path / "a.safetensors", clips[0], "big red plain circle bouncing on a black background")
    torch.save({"video": clips[1].half(), "caption": ""}, tmp_path / "b.pt")
    torch.save({"video": clips[2]}, tmp_path / "c.pth")
    (tmp_path / "notes.txt").write_text("ignored")
    video, caption = read_clip(tmp_path / "a.safetensors")
    assert torch.equal(video, clips[0]) and caption.startswith("big red")
    assert read_clip(tmp_path / "b.pt")[0].dtype == torch.float32 and read_clip(tmp_path / "c.pth")[1] == ""
    source = DirectorySource(tmp_path, seed=0)
    assert len(source) == 3 and source.clip_shape == (3, 4, 8, 8)
    for epoch in range(2):
        assert sorted(source.file(i).name for i in range(3 * epoch, 3 * epoch + 3)) == ["a.safetensors", "b.pt",
                                                                                         "c.pth"]
    video, captions = source.clips([0, 1, 2])
    assert video.shape == (3, 3, 4, 8, 8) and len(captions) == 3


@pytest.mark.parametrize("content,match", [
    ({"latent": torch.zeros(3, 4, 8, 8)}, "'video'"),
    ({"video": torch.zeros(3, 8, 8)}, r"\[C, T, H, W\]"),
    ({"video": torch.zeros(3, 4, 8, 8, dtype=torch.long)}, "floating-point"),
    ({"video": torch.zeros(3, 4, 8, 8), "caption": 3}, "'caption' must be a str"),
    ([1, 2], "expected a dict"),
], ids=["key", "ndim", "dtype", "caption", "not-a-dict"])
def test_bad_clip_files_fail_clearly(tmp_path, content, match):
    torch.save(content, tmp_path / "bad.pt")
    with pytest.raises(ValueError, match=match):
        read_clip(tmp_path / "bad.pt")


def test_bad_directories_fail_clearly(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        DirectorySource(tmp_path / "missing")
    with pytest.raises(ValueError, match="no clip files"):
        DirectorySource(tmp_path)
    (tmp_path / "x.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(ValueError, match="x.safetensors"):
        DirectorySource(tmp_path)
    (tmp_path / "x.safetensors").unlink()
    write_clip(tmp_path / "a.safetensors", torch.randn(3, 4, 8, 8))
    write_clip(tmp_path / "b.safetensors", torch.randn(3, 4, 8, 16))
    with pytest.raises(ValueError, match="b.safetensors: clip shape"):
        DirectorySource(tmp_path).clips([0, 1])


def test_teacher_cache_samples_once_and_is_reused(tmp_path):
    model = _tiny().eval()
    teacher_cache(model, tmp_path, count=3, seed=2, steps=1, guidance=1.0, batch_size=2)
    files = sorted(p.name for p in tmp_path.glob("clip_*"))
    assert files == ["clip_000000.safetensors", "clip_000001.safetensors", "clip_000002.safetensors"]
    video, caption = read_clip(tmp_path / files[1])
    assert video.shape == model.clip_shape and caption == ProceduralSource(model.data, 2).captions([1])[0]
    stamps = [p.stat().st_mtime_ns for p in sorted(tmp_path.glob("clip_*"))]
    again = teacher_cache(model, tmp_path, count=3, seed=2, steps=1, guidance=1.0)
    assert [p.stat().st_mtime_ns for p in sorted(tmp_path.glob("clip_*"))] == stamps and len(again) == 3
    teacher_cache(model, tmp_path, count=2, seed=2, steps=1, guidance=1.0)  # other settings: sampled again
    assert len(list(tmp_path.glob("clip_*"))) == 2


@pytest.mark.parametrize("kwargs,error,match", [
    ({"objective": "kd"}, ValueError, "objective"),
    ({"trainable": "mlp"}, ValueError, "trainable"),
    ({"batch_size": 0}, ValueError, "batch_size"),
    ({"batch_size": 2.0}, TypeError, "batch_size"),
    ({"sparse": {"rule": "topk"}}, TypeError, "sparse"),
    ({"sparse": sv.SparseConfig(dense_steps=2)}, ValueError, "dense_steps"),
    ({"null_prob": 1.0}, ValueError, "null_prob"),
    ({"shift": 0.0}, ValueError, "shift"),
    ({"gradient_checkpointing": 1}, TypeError, "gradient_checkpointing"),
], ids=["objective", "trainable", "batch", "batch-type", "sparse-type", "dense-steps", "null", "shift", "ckpt"])
def test_bad_distill_configs_name_the_argument(kwargs, error, match):
    with pytest.raises(error, match=match):
        DistillConfig(**kwargs)


def test_bad_calls_name_the_argument(tmp_path):
    from sparsevid_lab.cli import main

    model = _tiny()
    source = CaptionedClips(model, ProceduralSource(model.data, 0))
    with pytest.raises(TypeError, match="loop"):
        distill(model.transformer, source, DistillConfig(), {"max_steps": 1})
    with pytest.raises(ValueError, match="trainable"):
        trainable_names(model.transformer, "everything")
    sv.apply_sparse_attention(model.transformer, SPARSE)
    with pytest.raises(ValueError, match="already has sparse attention"):
        distill(model.transformer, source, DistillConfig(), _loop(1))
    assert main(["distill", "--out", str(tmp_path), "--tiny", "--max-steps", "1", "--data", "dir"]) == 2
    assert main(["distill", "--out", str(tmp_path), "--tiny", "--max-steps", "1", "--max-objects", "9"]) == 2
    assert main(["distill", "--out", str(tmp_path), "--tiny"]) == 2
