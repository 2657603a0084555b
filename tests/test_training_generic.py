"""The library's training path on tiny random diffusers transformers: latent folders, the dense teacher on the
student's own weights, velocity distillation and the diffusion baseline, the student format, the CLI."""
import json

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("safetensors")

import sparsevid as sv  # noqa: E402
from sparsevid.eval import heldout_loss, heldout_set, predict_velocities, velocity_error  # noqa: E402
from sparsevid.training import (DenseTeacher, DistillConfig, LatentBatch, LatentDirectory, LoopConfig,  # noqa: E402
                                distill, load_student, predict_velocity, trainable_names, write_latent_sample,
                                write_null_text)
from sparsevid.training.lora import adapters_off  # noqa: E402

from tiny_models import build  # noqa: E402

SPARSE = sv.SparseConfig(rule="topk", topk=2, block_q=64, block_k=64, tile="none")


def _latents(model_name: str, tmp_path, count: int = 6, seed: int = 0):
    """A latent folder fitting the tiny ``model_name`` (its inputs' latent and text shapes), random samples."""
    _, inputs = build(model_name)
    generator = torch.Generator().manual_seed(seed)
    latent_shape = inputs["hidden_states"].shape[1:]
    if model_name == "cogvideox":
        latent_shape = (latent_shape[1], latent_shape[0], *latent_shape[2:])
    text_shape = inputs["encoder_hidden_states"].shape[1:]
    folder = tmp_path / f"latents_{model_name}"
    for i in range(count):
        write_latent_sample(folder, i, torch.randn(*latent_shape, generator=generator),
                            torch.randn(*text_shape, generator=generator))
    write_null_text(folder, torch.zeros(*text_shape))
    return folder


def test_latent_directory_round_trips_and_checks(tmp_path):
    folder = _latents("wan", tmp_path, count=3)
    data = LatentDirectory(folder, seed=1)
    assert data.latent_shape == (4, 4, 16, 20) and data.text_shape == (12, 16) and len(data) == 3
    batch = data.batch([0, 1, 2, 3])  # index 3 is the first of epoch 1
    assert batch.latents.shape == (4, 4, 4, 16, 20) and batch.text.shape == (4, 12, 16)
    epoch0 = {data.file(i).name for i in range(3)}
    assert len(epoch0) == 3  # a permutation: every sample once per epoch
    with pytest.raises(ValueError, match="indices"):
        data.batch([])
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="no sample_"):
        LatentDirectory(empty)
    (folder / "null.safetensors").unlink()
    with pytest.raises(ValueError, match="empty prompt"):
        LatentDirectory(folder)


def test_drop_text_replaces_only_the_dropped_rows():
    batch = LatentBatch(torch.randn(3, 2, 1, 2, 2), torch.randn(3, 5, 4), torch.ones(3, 5, dtype=torch.long))
    null = (torch.full((5, 4), 7.0), torch.tensor([1, 0, 0, 0, 0]))
    dropped = batch.drop_text(torch.tensor([False, True, False]), null)
    assert torch.equal(dropped.text[0], batch.text[0]) and torch.equal(dropped.text[2], batch.text[2])
    assert torch.equal(dropped.text[1], null[0]) and dropped.text_mask[1].tolist() == [1, 0, 0, 0, 0]
    with pytest.raises(ValueError, match="empty prompt"):
        batch.drop_text(torch.tensor([True, False, False]), (torch.zeros(4, 4), None))


def test_dense_teacher_is_the_dense_model_on_its_original_weights():
    """After the student's weights move and its attention turns sparse, the teacher still gives the velocity the
    untouched dense model gives, at no cost of a second model."""
    model, inputs = build("wan")
    reference, _ = build("wan")
    names = trainable_names(model, "attention")
    assert names and all(".attn1." in n for n in names)
    teacher = DenseTeacher(model, names)
    sv.apply_sparse_attention(model, SPARSE)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name in names:
                parameter.add_(0.1 * torch.randn_like(parameter))
    x_t, t = inputs["hidden_states"], torch.tensor([0.7])
    batch = LatentBatch(x_t, inputs["encoder_hidden_states"])
    with torch.no_grad():
        expected = predict_velocity(reference, x_t, t, batch)
        student = predict_velocity(model, x_t, t, batch)
    assert torch.allclose(teacher(x_t, t, batch), expected, atol=1e-5)
    assert not torch.allclose(student, expected, atol=1e-3)
    assert sv.is_sparse(model)  # the teacher's pass leaves the student sparse


def test_noise_levels_of_a_range_follow_the_training_distribution_restricted_to_it():
    """An expert's fine-tuning draws its noise levels from the pre-training distribution (shifted logit-normal)
    restricted to the levels it serves: every draw inside, and distributed as the full draws that fall there."""
    from sparsevid.training.flow import sample_t

    n = 200_000
    inside = sample_t(n, torch.Generator().manual_seed(0), shift=3.0, noise_range=(0.2, 0.875))
    full = sample_t(4 * n, torch.Generator().manual_seed(1), shift=3.0)
    kept = full[(full >= 0.2) & (full <= 0.875)]
    assert 0.2 <= float(inside.min()) and float(inside.max()) <= 0.875
    for level in (0.3, 0.5, 0.7, 0.8):  # empirical CDFs agree within 5 standard errors of their difference
        share, reference = float((inside <= level).float().mean()), float((kept <= level).float().mean())
        standard_error = (reference * (1 - reference) * (1 / n + 1 / kept.numel())) ** 0.5
        assert abs(share - reference) < 5 * standard_error
    # The whole range draws as before (the same stream of normal draws).
    whole = sample_t(4, torch.Generator().manual_seed(2), shift=3.0)
    z = torch.randn(4, generator=torch.Generator().manual_seed(2))
    assert torch.equal(whole, 3.0 * torch.sigmoid(z) / (1 + 2.0 * torch.sigmoid(z)))


def test_a_distillation_restricted_to_a_noise_range_draws_there_and_records_it(tmp_path):
    from sparsevid.training.distill import Draws

    data = LatentDirectory(_latents("wan", tmp_path), seed=0)
    config = DistillConfig(sparse=SPARSE, batch_size=4, shift=3.0, noise_range=(0.0, 0.875))
    t = torch.cat([Draws(data, config, 0, 1, "cpu")(step)[1] for step in range(8)])
    assert float(t.max()) <= 0.875
    assert config.run_info(data)["noise_range"] == [0.0, 0.875]
    assert "noise_range" not in DistillConfig(sparse=SPARSE).run_info(data)  # runs before it resume as they were
    for bad in ((0.5, 0.5), (-0.1, 0.5), [0.0, 0.5]):
        with pytest.raises(ValueError, match="noise_range"):
            DistillConfig(sparse=SPARSE, noise_range=bad)


def test_heldout_triples_stratify_the_noise_range_they_are_given(tmp_path):
    data = LatentDirectory(_latents("wan", tmp_path), seed=0)
    whole, part = heldout_set(data, per_bin=2, num_bins=2), heldout_set(data, per_bin=2, num_bins=2,
                                                                         noise_range=(0.5, 0.9))
    assert torch.allclose(part.t, 0.5 + 0.4 * whole.t, rtol=0, atol=1e-7)  # the same draws in the range (float32)
    assert part.bin_edges == pytest.approx([0.5, 0.7, 0.9]) and torch.equal(part.bins, whole.bins)
    with pytest.raises(ValueError, match="noise_range"):
        heldout_set(data, per_bin=2, num_bins=2, noise_range=(0.9, 0.5))


@pytest.mark.parametrize("objective", ["distill", "diffusion"])
def test_distill_trains_a_tiny_wan_and_the_student_loads_back(tmp_path, objective):
    torch.manual_seed(0)
    model, _ = build("wan")
    data = LatentDirectory(_latents("wan", tmp_path), seed=0)
    heldout = heldout_set(data, per_bin=2, num_bins=2)
    dense_velocity = predict_velocities(model, heldout)
    before = velocity_error(predict_velocities(model, heldout, SPARSE), dense_velocity, heldout)["overall"]
    config = DistillConfig(objective=objective, sparse=SPARSE, trainable="attention", batch_size=2, null_prob=0.2)
    loop = LoopConfig(lr=3e-3, warmup_steps=2, ema_decay=None, max_steps=25, log_every=5, bf16=False)
    out = tmp_path / "student"
    result = distill(model, data, config, loop, out=out, log=lambda *_: None)
    assert result.finished and result.steps == 25 and sv.is_sparse(model)
    losses = [row["loss"] for row in result.history]
    assert losses[-1] < losses[0]
    trained = predict_velocities(model, heldout)
    if objective == "distill":  # it learns the teacher's velocity under sparse attention
        assert velocity_error(trained, dense_velocity, heldout)["overall"] < before
    record = json.loads((out / "student.json").read_text())
    assert record["trainable"] == "attention" and record["steps"] == 25
    assert record["transformer"] == "WanTransformer3DModel"
    fresh, _ = build("wan")  # the same base weights (seeded)
    config = load_student(fresh, out)
    assert config == SPARSE and sv.is_sparse(fresh)
    assert torch.allclose(predict_velocities(fresh, heldout), trained, atol=1e-2)
    assert heldout_loss(trained, heldout)["overall"] > 0


def test_load_student_refuses_another_base_and_another_model(tmp_path):
    torch.manual_seed(0)
    model, _ = build("wan")
    data = LatentDirectory(_latents("wan", tmp_path), seed=0)
    loop = LoopConfig(lr=1e-3, warmup_steps=0, ema_decay=None, max_steps=2, bf16=False)
    distill(model, data, DistillConfig(sparse=SPARSE, batch_size=2), loop, out=tmp_path / "s", log=lambda *_: None)
    other, _ = build("wan")
    with torch.no_grad():
        other.blocks[0].attn1.to_q.weight.add_(1.0)
    with pytest.raises(ValueError, match="not the base"):
        load_student(other, tmp_path / "s")
    hunyuan, _ = build("hunyuan_video")
    with pytest.raises(ValueError, match="WanTransformer3DModel"):
        load_student(hunyuan, tmp_path / "s")
    with pytest.raises(FileNotFoundError, match="student folder"):
        load_student(other, tmp_path)


def test_distill_refuses_data_for_another_model_and_non_flow_families(tmp_path):
    model, _ = build("wan", in_channels=8, out_channels=8)
    data = LatentDirectory(_latents("wan", tmp_path), seed=0)
    loop = LoopConfig(max_steps=1)
    with pytest.raises(ValueError, match="4 channels"):
        distill(model, data, DistillConfig(sparse=SPARSE, batch_size=2), loop)
    cog, _ = build("cogvideox")
    with pytest.raises(TypeError, match="v_prediction"):
        distill(cog, data, DistillConfig(sparse=SPARSE, batch_size=2), loop)
    sparse_already, _ = build("wan")
    sv.apply_sparse_attention(sparse_already, SPARSE)
    with pytest.raises(ValueError, match="already has sparse attention"):
        distill(sparse_already, data, DistillConfig(sparse=SPARSE, batch_size=2), loop)


def test_hunyuan_video_trains_through_the_same_path(tmp_path):
    """Joint text+video attention, a text mask and extra inputs (pooled projections, guidance) per sample."""
    torch.manual_seed(0)
    model, inputs = build("hunyuan_video")
    folder = tmp_path / "hv"
    for i in range(4):
        write_latent_sample(folder, i, torch.randn(4, 3, 10, 10), torch.randn(12, 16),
                            text_mask=inputs["encoder_attention_mask"][i % 2],
                            extra={"pooled_projections": torch.randn(8), "guidance": torch.tensor(3000.0)})
    write_null_text(folder, torch.zeros(12, 16), torch.tensor([1] + [0] * 11))
    data = LatentDirectory(folder)
    config = DistillConfig(sparse=sv.SparseConfig(rule="topk", topk=1, block_q=64, block_k=64), batch_size=2)
    loop = LoopConfig(lr=3e-3, warmup_steps=0, ema_decay=None, max_steps=6, log_every=2, bf16=False)
    result = distill(model, data, config, loop, log=lambda *_: None)
    assert result.finished and all(torch.isfinite(torch.tensor(r["loss"])) for r in result.history)


def test_mochi_velocity_follows_its_sampler_inverted_time():
    """Mochi's scheduler inverts the sigmas (timestep 1000 (1 - t), output x0 - noise): one Euler step of it moves
    the latents along the velocity predict_velocity gives; a batch without text masks takes every token as valid."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    model, inputs = build("mochi")
    x_t, text, text_mask = (inputs[name] for name in ("hidden_states", "encoder_hidden_states",
                                                      "encoder_attention_mask"))
    scheduler = FlowMatchEulerDiscreteScheduler(invert_sigmas=True)
    scheduler.set_timesteps(sigmas=[0.8, 0.5])  # noise levels, as MochiPipeline passes them
    timestep = scheduler.timesteps[0]
    with torch.no_grad():
        raw = model(x_t, text, timestep.expand(2), text_mask, return_dict=False)[0]
        velocity = predict_velocity(model, x_t, torch.tensor([0.8, 0.8]), LatentBatch(x_t, text, text_mask))
        unmasked = predict_velocity(model, x_t, torch.tensor([0.8, 0.8]), LatentBatch(x_t, text))
        all_valid = predict_velocity(model, x_t, torch.tensor([0.8, 0.8]),
                                     LatentBatch(x_t, text, torch.ones_like(text_mask)))
    stepped = scheduler.step(raw, timestep, x_t, return_dict=False)[0]
    assert torch.allclose(stepped, x_t + (0.5 - 0.8) * velocity, atol=1e-5)
    assert torch.equal(unmasked, all_valid) and not torch.allclose(unmasked, velocity, atol=1e-3)


def test_mochi_trains_through_the_same_path_and_loads_back(tmp_path):
    """Mochi: joint attention over each sample's valid text tokens (text masks of different lengths), inverted time."""
    torch.manual_seed(0)
    model, inputs = build("mochi")
    folder = tmp_path / "mochi"
    for i in range(4):
        write_latent_sample(folder, i, torch.randn(4, 4, 16, 20), torch.randn(12, 16),
                            text_mask=inputs["encoder_attention_mask"][i % 2])
    write_null_text(folder, torch.zeros(12, 16), torch.zeros(12, dtype=torch.bool))
    loop = LoopConfig(lr=3e-3, warmup_steps=0, ema_decay=None, max_steps=4, log_every=1, bf16=False)
    result = distill(model, LatentDirectory(folder), DistillConfig(sparse=SPARSE, batch_size=2, null_prob=0.5), loop,
                     out=tmp_path / "s", log=lambda *_: None)
    assert result.finished and all(0 < row["loss"] < float("inf") for row in result.history)
    fresh, _ = build("mochi")
    base, trained = fresh.state_dict(), model.state_dict()
    assert load_student(fresh, tmp_path / "s") == SPARSE and sv.is_sparse(fresh)
    names = trainable_names(model, "attention")  # saved in bf16
    assert names and not all(torch.equal(trained[n], base[n]) for n in names)
    assert all(torch.equal(fresh.state_dict()[n], trained[n].bfloat16().float()) for n in names)


def test_cli_distill_and_evaluate_on_a_saved_transformer(tmp_path, capsys):
    from sparsevid.cli import main

    torch.manual_seed(0)
    model, _ = build("wan")
    model.save_pretrained(tmp_path / "model")
    data = _latents("wan", tmp_path)
    spec = "rule=topk,topk=2,block_q=64,block_k=64,tile=none"
    assert main(["distill", "--model", str(tmp_path / "model"), "--data", str(data), "--out", str(tmp_path / "out"),
                 "--sparse", spec, "--steps", "3", "--batch-size", "2", "--device", "cpu"]) == 0
    assert (tmp_path / "out" / "student.safetensors").is_file()
    assert main(["evaluate", "--model", str(tmp_path / "model"), "--data", str(data), "--student",
                 str(tmp_path / "out"), "--per-bin", "1", "--bins", "2", "--device", "cpu",
                 "--out", str(tmp_path / "eval.json")]) == 0
    result = json.loads((tmp_path / "eval.json").read_text())
    assert result["velocity_error"]["overall"] > 0 and len(result["velocity_error"]["per_bin"]) == 2
    assert main(["distill", "--model", str(tmp_path / "model"), "--data", str(data), "--out", str(tmp_path / "lora"),
                 "--sparse", spec, "--steps", "2", "--batch-size", "2", "--trainable", "lora", "--lora-rank", "2",
                 "--device", "cpu"]) == 0
    assert json.loads((tmp_path / "lora" / "student.json").read_text())["lora"]["rank"] == 2
    assert main(["distill", "--model", str(tmp_path / "model"), "--data", str(data), "--out", str(tmp_path / "acc"),
                 "--sparse", spec, "--steps", "2", "--batch-size", "4", "--accumulation-steps", "2", "--heldout",
                 str(data), "--eval-every", "1", "--heldout-per-bin", "1", "--device", "cpu"]) == 0
    rows = (tmp_path / "acc" / "eval.jsonl").read_text().splitlines()
    assert [json.loads(row)["step"] for row in rows] == [1, 2]
    assert main(["distill", "--model", str(tmp_path / "nothing"), "--data", str(data), "--out",
                 str(tmp_path / "o2"), "--steps", "1", "--device", "cpu"]) == 2
    assert "error:" in capsys.readouterr().err


def test_lora_student_trains_adapters_only_and_merges_into_its_base(tmp_path):
    """trainable='lora': the base weights stay as they were, the teacher is the model with its adapters off, and
    the student file (the adapters alone) merges into a fresh base to the velocity the trained student gives."""
    pytest.importorskip("peft")
    torch.manual_seed(0)
    model, _ = build("wan")
    base_state = {k: v.clone() for k, v in model.state_dict().items()}
    data = LatentDirectory(_latents("wan", tmp_path), seed=0)
    heldout = heldout_set(data, per_bin=2, num_bins=2)
    dense_velocity = predict_velocities(model, heldout)
    before = velocity_error(predict_velocities(model, heldout, SPARSE), dense_velocity, heldout)["overall"]
    config = DistillConfig(sparse=SPARSE, trainable="lora", lora_rank=4, lora_alpha=8.0, batch_size=2, null_prob=0.2)
    loop = LoopConfig(lr=1e-2, warmup_steps=2, ema_decay=None, max_steps=25, log_every=5, bf16=False)
    result = distill(model, data, config, loop, out=tmp_path / "lora", log=lambda *_: None)
    assert result.trainable_parameters == sum(p.numel() for n, p in model.named_parameters() if ".lora_" in n)
    for name, value in model.state_dict().items():  # peft names the wrapped layers' weights base_layer.weight
        plain = name.replace(".base_layer.", ".")
        if ".lora_" not in name:
            assert torch.equal(value, base_state[plain]), name
    trained = predict_velocities(model, heldout)
    assert velocity_error(trained, dense_velocity, heldout)["overall"] < before
    with sv.dense_attention(model), adapters_off(model):  # what the teacher ran: the untouched dense model
        assert torch.allclose(predict_velocities(model, heldout), dense_velocity, atol=1e-5)
    record = json.loads((tmp_path / "lora" / "student.json").read_text())
    assert record["trainable"] == "lora" and record["lora"]["rank"] == 4 and len(record["lora"]["targets"]) == 12
    fresh, _ = build("wan")
    load_student(fresh, tmp_path / "lora")  # merged: a plain diffusers model again, with sparse attention
    assert not any(".lora_" in n for n, _ in fresh.named_parameters()) and sv.is_sparse(fresh)
    assert torch.allclose(predict_velocities(fresh, heldout), trained, atol=1e-2)
    other, _ = build("wan", num_layers=3)
    with torch.no_grad():
        other.blocks[1].attn1.to_v.weight.mul_(2.0)
    with pytest.raises(ValueError, match="not the base"):
        load_student(other, tmp_path / "lora")


def test_gradient_accumulation_follows_the_same_trajectory_as_one_big_batch(tmp_path):
    """Two micro-steps of 2 samples make the optimiser step of a batch of 4: the same samples, draws, losses
    and weights (up to the order of floating-point sums)."""
    data = LatentDirectory(_latents("wan", tmp_path), seed=0)
    runs = []
    for accumulation in (1, 2):
        torch.manual_seed(0)
        model, _ = build("wan")
        loop = LoopConfig(lr=3e-3, warmup_steps=1, ema_decay=None, max_steps=4, log_every=1, bf16=False,
                          accumulation_steps=accumulation)
        result = distill(model, data, DistillConfig(sparse=SPARSE, batch_size=4), loop, log=lambda *_: None)
        runs.append(([r["loss"] for r in result.history], model.state_dict()))
    (loss_1, state_1), (loss_2, state_2) = runs
    assert loss_2 == pytest.approx(loss_1, rel=1e-5)
    for name, value in state_1.items():
        assert torch.allclose(value, state_2[name], atol=1e-6), name
    with pytest.raises(ValueError, match="accumulation steps"):
        distill(build("wan")[0], data, DistillConfig(sparse=SPARSE, batch_size=3),
                LoopConfig(max_steps=1, accumulation_steps=2), log=lambda *_: None)


def test_held_out_velocity_error_is_logged_during_training_and_falls(tmp_path):
    from sparsevid.eval import velocity_tracker

    torch.manual_seed(0)
    model, _ = build("wan")
    data = LatentDirectory(_latents("wan", tmp_path), seed=0)
    heldout = heldout_set(data, per_bin=2, num_bins=2)
    tracker = velocity_tracker(model, heldout)  # the dense reference, taken before training
    training_free = velocity_error(predict_velocities(model, heldout, SPARSE), predict_velocities(model, heldout),
                                   heldout)["overall"]
    loop = LoopConfig(lr=3e-3, warmup_steps=2, ema_decay=None, max_steps=20, log_every=5, bf16=False, eval_every=10)
    result = distill(model, data, DistillConfig(sparse=SPARSE, batch_size=2), loop, out=tmp_path / "run",
                     log=lambda *_: None, evaluate=tracker)
    assert [row["step"] for row in result.evaluations] == [10, 20]
    rows = [json.loads(line) for line in (tmp_path / "run" / "eval.jsonl").read_text().splitlines()]
    assert rows == json.loads(json.dumps(result.evaluations))
    assert rows[-1]["heldout_velocity_error"] < training_free  # distillation closed part of the sparse gap
    assert len(rows[0]["heldout_velocity_error_per_bin"]) == 2 and rows[0]["heldout_loss"] > 0


@pytest.mark.parametrize("trainable", ["attention", "lora"])
def test_two_sharded_processes_match_one(tmp_path, trainable, torchrun):
    """FSDP2 over two CPU processes (gloo): the same losses, training state and student as one process."""
    from safetensors.torch import load_file

    if trainable == "lora":
        pytest.importorskip("peft")
    torch.manual_seed(0)
    model, _ = build("wan")
    model.save_pretrained(tmp_path / "model")
    data = _latents("wan", tmp_path, count=8)
    args = ["distill", "--model", str(tmp_path / "model"), "--data", str(data), "--sparse",
            "rule=topk,topk=2,block_q=64,block_k=64,tile=none", "--steps", "3", "--batch-size", "4", "--lr", "3e-3",
            "--warmup", "1", "--trainable", trainable, "--lora-rank", "2", "--checkpoint-every", "2",
            "--device", "cpu"]
    from sparsevid.cli import main

    assert main([*args, "--out", str(tmp_path / "one")]) == 0
    sharded = ["-m", "sparsevid", *args, "--parallel", "fsdp", "--out", str(tmp_path / "two")]
    done = torchrun(sharded, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("student in") == 1  # the main process alone reports
    rows = [[json.loads(line) for line in (tmp_path / run / "log.jsonl").read_text().splitlines()]
            for run in ("one", "two")]
    assert [r["loss"] for r in rows[1]] == pytest.approx([r["loss"] for r in rows[0]], rel=1e-5)
    assert rows[0][-1]["loss"] != rows[0][0]["loss"]
    for name in ("student.safetensors", "state.safetensors"):
        one, two = load_file(tmp_path / "one" / name), load_file(tmp_path / "two" / name)
        assert set(one) == set(two), name
        for key, value in one.items():
            if not key.startswith("rng."):
                assert torch.allclose(value.float(), two[key].float(), rtol=1e-4, atol=1e-6), (name, key)
    # Resuming the finished sharded run loads its whole state back onto the shards and has nothing left to do.
    again = torchrun([*sharded, "--resume"], cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from" in again.stdout and len((tmp_path / "two" / "log.jsonl").read_text().splitlines()) == 3


@pytest.mark.parametrize("name", ["chronoedit", "skyreels_v2"])
def test_wan_layout_families_distill_and_load_back(tmp_path, name):
    """Families of Wan's layout train through the same path on Wan-shaped latents and load back as students."""
    torch.manual_seed(0)
    model, _ = build(name)
    data = LatentDirectory(_latents("wan", tmp_path), seed=0)
    loop = LoopConfig(lr=3e-3, warmup_steps=1, ema_decay=None, max_steps=4, log_every=1, bf16=False)
    result = distill(model, data, DistillConfig(sparse=SPARSE, batch_size=2), loop, out=tmp_path / "s",
                     log=lambda *_: None)
    assert result.finished and 0 < result.history[-1]["loss"] < result.history[0]["loss"] * 10
    fresh, _ = build(name)
    assert load_student(fresh, tmp_path / "s") == SPARSE and sv.is_sparse(fresh)


def test_cached_data_of_another_family_are_refused(tmp_path):
    """Shards record the family whose pipeline made them: Wan latents suit ChronoEdit (Wan's VAE and text encoder),
    HunyuanVideo's do not suit Wan, even with the same channels and text width."""
    from sparsevid.training import ShardWriter

    for family in ("hunyuan_video", "wan"):
        with ShardWriter(tmp_path / family, {"family": family}) as writer:
            for _ in range(2):
                writer.add(torch.randn(4, 4, 16, 20), torch.randn(12, 16))
        write_null_text(tmp_path / family, torch.zeros(12, 16))
    loop = LoopConfig(max_steps=1, ema_decay=None, bf16=False)
    with pytest.raises(ValueError, match="'hunyuan_video' pipeline.*'wan' latents"):
        distill(build("wan")[0], LatentDirectory(tmp_path / "hunyuan_video"),
                DistillConfig(sparse=SPARSE, batch_size=2), loop, log=lambda *_: None)
    result = distill(build("chronoedit")[0], LatentDirectory(tmp_path / "wan"),
                     DistillConfig(sparse=SPARSE, batch_size=2), loop, log=lambda *_: None)
    assert result.finished


def test_compiled_student_follows_the_eager_trajectory(tmp_path):
    """DistillConfig(compile=...) compiles the repeated blocks (here with the aot_eager backend: dynamo capture and
    the custom ops' fake kernels, no code generation): the same losses and weights as eager, up to float32 sums."""
    data = LatentDirectory(_latents("wan", tmp_path), seed=0)
    runs = []
    for backend in (None, "aot_eager"):
        torch.manual_seed(0)
        model, _ = build("wan")
        config = DistillConfig(sparse=SPARSE, batch_size=2, gradient_checkpointing=True, compile=backend)
        loop = LoopConfig(lr=3e-3, warmup_steps=1, ema_decay=None, max_steps=3, log_every=1, bf16=False)
        result = distill(model, data, config, loop, log=lambda *_: None)
        assert all((block._compiled_call_impl is not None) == (backend is not None) for block in model.blocks)
        runs.append(([r["loss"] for r in result.history], model.state_dict()))
        torch._dynamo.reset()
    (eager_loss, eager_state), (compiled_loss, compiled_state) = runs
    assert compiled_loss == pytest.approx(eager_loss, rel=1e-4) and eager_loss[-1] != eager_loss[0]
    for name, value in eager_state.items():
        assert torch.allclose(value, compiled_state[name], atol=1e-5), name
    with pytest.raises(ValueError, match="compile must be None or a torch.compile backend"):
        DistillConfig(compile="no-such-backend")


def test_a_bf16_base_trains_float32_master_weights_and_evaluates_under_autocast(tmp_path):
    """A transformer loaded in bf16: the tensors the student trains become float32 (the optimiser's master
    weights), the frozen ones stay bf16, and the held-out yardstick runs the mixed model as training does
    (autocast), close to the float32 model it was rounded from."""
    from sparsevid.training import prepare_distillation

    torch.manual_seed(0)
    model, _ = build("wan")
    data = LatentDirectory(_latents("wan", tmp_path), seed=0)
    heldout = heldout_set(data, per_bin=1, num_bins=2)
    reference = predict_velocities(model, heldout)
    model.to(torch.bfloat16)
    run = prepare_distillation(model, data, DistillConfig(sparse=SPARSE, batch_size=2), torch.device("cpu"))
    trained = set(trainable_names(model, "attention"))
    assert {n for n, p in model.named_parameters() if p.dtype == torch.float32} == trained
    assert [id(p) for p in run.parameters] == [id(p) for n, p in model.named_parameters() if n in trained]
    with sv.dense_attention(model):
        mixed = predict_velocities(model, heldout)
    error = velocity_error(mixed, reference, heldout)["overall"]
    assert 0 < error < 0.05  # bf16 rounding of weights and activations (8 mantissa bits), not a wrong model


def test_cli_out_of_memory_names_what_would_cut_memory(tmp_path, capsys, monkeypatch):
    """A run that runs out of GPU memory ends with a clear error listing the options it does not use yet."""
    import sparsevid.training
    from sparsevid.cli import main

    def out_of_memory(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    torch.manual_seed(0)
    build("wan")[0].save_pretrained(tmp_path / "model")
    data = _latents("wan", tmp_path, count=2)
    monkeypatch.setattr(sparsevid.training, "distill", out_of_memory)
    base = ["distill", "--model", str(tmp_path / "model"), "--data", str(data), "--steps", "1", "--device", "cpu"]
    assert main([*base, "--out", str(tmp_path / "a")]) == 2
    first = capsys.readouterr().err
    assert "out of GPU memory" in first and "--gradient-checkpointing" in first and "--trainable lora" in first
    assert main([*base, "--out", str(tmp_path / "b"), "--gradient-checkpointing", "--trainable", "lora"]) == 2
    second = capsys.readouterr().err
    assert "--gradient-checkpointing" not in second and "--trainable lora" not in second and "adamw8bit" in second
