"""The built-in video DiT: shapes, the caption encoder, training steps, checkpoints, sampling."""
import json
import math

import pytest
import torch

from sparsevid_lab.model.builtin import DEFAULT_CONFIG, BuiltinVideoDiT, deepen, load_builtin, tiny_config
from sparsevid_lab.model.caption_encoder import CaptionEncoder
from sparsevid_lab.model.sampling import generate, initial_noise
from sparsevid.training import (EMA, LoopConfig, learning_rate, load_training_state, sample_t, train_loop)
from sparsevid_lab.model.builtin import export_builtin, pretraining_loss


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return BuiltinVideoDiT(tiny_config()).eval()


def test_forward_shapes(tiny):
    c, t, h, w = tiny.clip_shape
    x = torch.randn(3, c, t, h, w)
    tokens = tiny.tokenize(["big red plain circle bouncing on a black background", "", "small blue striped ring "
                            "circling and big white plain square moving up on a navy background"])
    out = tiny(x, torch.rand(3), tokens)
    assert out.shape == x.shape and torch.isfinite(out).all()


def test_default_config_is_a_wan_model_with_4096_tokens():
    from diffusers import WanTransformer3DModel

    model = BuiltinVideoDiT(DEFAULT_CONFIG)
    assert isinstance(model.transformer, WanTransformer3DModel)
    _, t, h, w = model.clip_shape
    p = model.transformer.config.patch_size
    assert (t // p[0]) * (h // p[1]) * (w // p[2]) == 4096
    assert model.transformer.config.attention_head_dim == 128
    assert sum(p.numel() for p in model.parameters()) * 2 <= 20e6  # bf16 weights fit in 20 MB


def test_caption_encoder_checks_and_null_caption():
    enc = CaptionEncoder(vocab_size=10, length=6, dim=16, layers=1, heads=2)
    out = enc(torch.zeros(2, 6, dtype=torch.long))
    assert out.shape == (2, 6, 16)
    with pytest.raises(ValueError, match="length"):
        enc(torch.zeros(2, 5, dtype=torch.long))
    with pytest.raises(TypeError, match="tokens"):
        enc(torch.zeros(2, 6))
    with pytest.raises(ValueError, match="heads"):
        CaptionEncoder(vocab_size=10, length=6, dim=15, heads=2)


def test_config_sections_are_checked():
    config = tiny_config()
    del config["data"]
    with pytest.raises(ValueError, match="data"):
        BuiltinVideoDiT(config)
    config = tiny_config()
    config["caption_encoder"]["dim"] = 48
    with pytest.raises(ValueError, match="text_dim"):
        BuiltinVideoDiT(config)


def test_flow_matching_loss_target():
    """With a model that returns the exact velocity the loss is zero; with zeros it is E|noise - x0|^2."""
    x0, noise = torch.randn(2, 3, 2, 4, 4), torch.randn(2, 3, 2, 4, 4)
    t = torch.tensor([0.25, 0.8])
    exact = lambda x_t, tt, tok: noise - x0  # noqa: E731
    assert float(pretraining_loss(exact, x0, None, t, noise)) == 0.0
    zero = lambda x_t, tt, tok: torch.zeros_like(x_t)  # noqa: E731
    assert torch.isclose(pretraining_loss(zero, x0, None, t, noise), ((noise - x0) ** 2).mean())
    seen = {}

    def spy(x_t, tt, tok):
        seen["x_t"] = x_t
        return x_t

    pretraining_loss(spy, x0, None, t, noise)
    assert torch.allclose(seen["x_t"][1], 0.2 * x0[1] + 0.8 * noise[1])
    with pytest.raises(ValueError, match="t must"):
        pretraining_loss(spy, x0, None, torch.rand(3), noise)


def test_sample_t_range_and_shift():
    g = torch.Generator().manual_seed(0)
    t1 = sample_t(4000, g, shift=1.0)
    t3 = sample_t(4000, torch.Generator().manual_seed(0), shift=3.0)
    assert t1.min() > 0 and t1.max() < 1 and abs(float(t1.mean()) - 0.5) < 0.02
    assert (t3 >= t1).all() and float(t3.mean()) > 0.65
    with pytest.raises(ValueError, match="shift"):
        sample_t(4, g, shift=0.0)


def test_learning_rate_schedule():
    cfg = LoopConfig(lr=1e-3, warmup_steps=10, max_steps=100, min_lr_ratio=0.1)
    assert learning_rate(cfg, 0, 0.0) == pytest.approx(1e-4)
    assert learning_rate(cfg, 10, 0.0) == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5 * (1 + math.cos(0.1 * math.pi))))
    assert learning_rate(cfg, 100, 0.0) == pytest.approx(1e-4)
    timed = LoopConfig(lr=1e-3, warmup_steps=0, max_seconds=10.0)
    assert learning_rate(timed, 5, 10.0) == pytest.approx(1e-4)
    with pytest.raises(ValueError, match="max_steps or max_seconds"):
        LoopConfig()


def _tiny_loss(model, batch=8, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    data = model.data

    def loss_fn(step):
        video, captions = data.sample(batch, gen)
        t = sample_t(batch, gen, shift=2.0)
        noise = torch.randn(video.shape, generator=gen)
        return pretraining_loss(model, video.to(device), model.tokenize(captions).to(device), t.to(device),
                                  noise.to(device))
    return loss_fn


def test_training_steps_reduce_the_loss(tmp_path):
    torch.manual_seed(0)
    model = BuiltinVideoDiT(tiny_config())
    eval_gen = torch.Generator().manual_seed(123)
    video, captions = model.data.sample(16, eval_gen)
    t, noise = sample_t(16, eval_gen, shift=2.0), torch.randn(video.shape, generator=eval_gen)
    with torch.no_grad():
        before = float(pretraining_loss(model, video, model.tokenize(captions), t, noise))
    result = train_loop(model, _tiny_loss(model), LoopConfig(lr=3e-3, warmup_steps=5, max_steps=40, log_every=10),
                        state_path=tmp_path / "state.safetensors", log=lambda line: None)
    with torch.no_grad():
        after = float(pretraining_loss(model, video, model.tokenize(captions), t, noise))
    assert result.steps == 40 and len(result.history) >= 4
    assert after < 0.75 * before, (before, after)
    assert (tmp_path / "state.safetensors").is_file()


def test_training_state_round_trip_and_resume(tmp_path):
    torch.manual_seed(0)
    model = BuiltinVideoDiT(tiny_config())
    cfg = LoopConfig(lr=1e-3, warmup_steps=2, max_steps=3, log_every=1)
    path = tmp_path / "state.safetensors"
    result = train_loop(model, _tiny_loss(model, batch=2), cfg, state_path=path, log=lambda line: None)
    assert not list(tmp_path.glob(".*tmp"))  # atomic write leaves no temporary file behind
    fresh = BuiltinVideoDiT(tiny_config())
    ema = EMA(fresh)
    optimizer = torch.optim.AdamW([{"params": [p for p in fresh.parameters() if p.dim() >= 2]},
                                   {"params": [p for p in fresh.parameters() if p.dim() < 2]}])
    step, _ = load_training_state(path, fresh, ema.shadow, optimizer)
    assert step == 3
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), name
    for name, value in result.ema.shadow.items():
        assert torch.equal(value, ema.shadow[name]), name
    assert len(optimizer.state) == len(list(fresh.parameters()))
    resumed = train_loop(fresh, _tiny_loss(fresh, batch=2), LoopConfig(lr=1e-3, warmup_steps=2, max_steps=5),
                         state_path=path, resume=True, log=lambda line: None)
    assert resumed.steps == 5 and resumed.history[-1]["step"] == 5


@pytest.mark.gpu
def test_resume_on_cuda_with_the_fused_optimizer(tmp_path):
    """The fused AdamW of CUDA keeps its step counts on the device; a resumed run must put them back there."""
    torch.manual_seed(0)
    path = tmp_path / "state.safetensors"
    model = BuiltinVideoDiT(tiny_config()).cuda()
    loop = LoopConfig(warmup_steps=1, max_steps=2, ema_decay=None)
    train_loop(model, _tiny_loss(model, batch=2, device="cuda"), loop, state_path=path, log=lambda line: None)
    fresh = BuiltinVideoDiT(tiny_config()).cuda()
    resumed = train_loop(fresh, _tiny_loss(fresh, batch=2, device="cuda"),
                         LoopConfig(warmup_steps=1, max_steps=4, ema_decay=None), state_path=path, resume=True,
                         log=lambda line: None)
    assert resumed.steps == 4 and resumed.history[-1]["step"] == 4


def test_export_and_load_builtin(tmp_path, tiny):
    export_builtin(tiny, tmp_path, dtype=torch.float32, extra={"training": {"steps": 1}})
    loaded = load_builtin(tmp_path)
    assert json.loads((tmp_path / "builtin.json").read_text())["training"] == {"steps": 1}
    for (name, a), b in zip(tiny.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name
    with pytest.raises(FileNotFoundError, match="builtin"):
        load_builtin(tmp_path / "missing")
    with pytest.raises(TypeError, match="dtype must be a floating-point torch.dtype"):
        load_builtin(tmp_path, dtype=torch.int64)


def test_shipped_weights_load():
    model = load_builtin()
    assert model.clip_shape == (3, 32, 128, 128)  # Wan2.1-1.3B's length: 32 x 32 x 32 = 32,768 tokens
    assert model.config["training"]["steps"] > 0 and model.config["sampling"]["steps"] == 10
    assert model.use_cpu_defaults() == {"clip": [16, 64, 64], "steps": 6}
    assert model.clip_shape == (3, 16, 64, 64) and model.config["sampling"]["steps"] == 6


def test_cpu_defaults_are_optional_and_can_keep_the_clip():
    tiny = BuiltinVideoDiT(tiny_config())  # its own instance: the test changes its clip
    assert tiny.use_cpu_defaults() == {}  # no CPU defaults in its config: nothing changes
    tiny.config["sampling"]["cpu"] = {"clip": [2, 16, 16], "steps": 3}
    assert tiny.use_cpu_defaults(clip=False) == {"steps": 3} and tiny.clip_shape == (3, 4, 32, 32)
    tiny.config["sampling"]["steps"] = 5
    assert tiny.use_cpu_defaults(clip=False, steps=False) == {} and tiny.config["sampling"]["steps"] == 5
    assert tiny.use_cpu_defaults() == {"clip": [2, 16, 16], "steps": 3} and tiny.clip_shape == (3, 2, 16, 16)


def test_sampler_is_deterministic_and_seeded(tiny):
    caption = ["big red plain circle bouncing on a black background"]
    a = generate(tiny, caption, [7], steps=3)
    b = generate(tiny, caption, [7], steps=3)
    c = generate(tiny, caption, [8], steps=3)
    assert a.shape == (1, *tiny.clip_shape) and torch.equal(a, b) and not torch.equal(a, c)
    assert a.min() >= -1 and a.max() <= 1
    assert torch.equal(initial_noise((2, 3), [5])[0], torch.randn(2, 3, generator=torch.Generator().manual_seed(5)))
    euler = generate(tiny, caption, [7], steps=3, scheduler="euler")
    assert not torch.equal(a, euler)
    with pytest.raises(ValueError, match="scheduler"):
        generate(tiny, caption, [7], steps=3, scheduler="ddim")
    with pytest.raises(ValueError, match="same length"):
        generate(tiny, caption, [1, 2])
    with pytest.raises(ValueError, match="guidance"):
        generate(tiny, caption, [1], guidance=0.5)


def test_train_cli_smoke(tmp_path):
    from sparsevid_lab.cli import main

    assert main(["train", "--out", str(tmp_path), "--tiny", "--max-steps", "3", "--batch-size", "2",
                 "--warmup", "1", "--sample-steps", "2"]) == 0
    for name in ("builtin.safetensors", "builtin.json", "loss.png", "history.json", "samples.gif", "samples.png",
                 "train_log.txt"):
        assert (tmp_path / name).stat().st_size > 0, name
    assert load_builtin(tmp_path).config["training"]["steps"] == 3


def test_use_clip_changes_the_clip_shape_and_checks_the_patch():
    model = BuiltinVideoDiT(tiny_config()).eval()
    model.use_clip(2, 16, 24)
    assert model.clip_shape == (3, 2, 16, 24)
    video, _ = model.data.sample(1, torch.Generator().manual_seed(0))
    assert video.shape == (1, 3, 2, 16, 24)
    with torch.no_grad():
        assert model(video, torch.tensor([0.5]), model.tokenize([""])).shape == video.shape
    with pytest.raises(ValueError, match="width must be a positive multiple of the patch size"):
        model.use_clip(2, 16, 22)


def _two_layer_tiny() -> BuiltinVideoDiT:
    config = tiny_config()
    config["transformer"]["num_layers"] = 2
    torch.manual_seed(0)
    model = BuiltinVideoDiT(config).eval()
    for block in model.transformer.blocks:  # no block weight zero by construction: a silent copy is deepen's doing
        for p in block.parameters():
            p.data.add_(0.02 * torch.randn_like(p))
    return model


def test_deepen_keeps_the_function_and_places_silent_copies():
    model = _two_layer_tiny()
    grown = deepen(model, 5)  # blocks 0 0 0 1 1: j * 2 // 5
    assert grown.config["transformer"]["num_layers"] == 5 and len(grown.transformer.blocks) == 5
    assert model.config["transformer"]["num_layers"] == 2 and not grown.training
    for j, source, silent in ((0, 0, False), (1, 0, True), (2, 0, True), (3, 1, False), (4, 1, True)):
        block, original = grown.transformer.blocks[j], model.transformer.blocks[source]
        assert torch.equal(block.attn1.to_q.weight, original.attn1.to_q.weight), j
        outputs = (block.attn1.to_out[0].weight, block.attn2.to_out[0].bias, block.ffn.net[2].weight)
        assert all(not w.any() for w in outputs) == silent, j
    c, t, h, w = model.clip_shape
    x = torch.randn(2, c, t, h, w, generator=torch.Generator().manual_seed(1))
    tokens = model.tokenize(["big red plain circle bouncing on a black background", ""])
    with torch.no_grad():
        assert torch.equal(grown(x, torch.tensor([0.3, 0.8]), tokens), model(x, torch.tensor([0.3, 0.8]), tokens))
    assert deepen(model, 2).state_dict().keys() == model.state_dict().keys()


def test_deepened_copies_learn():
    grown = deepen(_two_layer_tiny(), 4).train()
    video, captions = grown.data.sample(2, torch.Generator().manual_seed(0))
    loss = pretraining_loss(grown, video, grown.tokenize(captions), torch.tensor([0.4, 0.7]), torch.randn_like(video))
    loss.backward()
    later_copy = grown.transformer.blocks[1]  # silent at first; its output layers get gradients, so it starts to add
    assert later_copy.attn1.to_out[0].weight.grad.abs().sum() > 0 and later_copy.ffn.net[2].weight.grad.abs().sum() > 0


def test_deepen_checks_its_argument():
    model = _two_layer_tiny()
    with pytest.raises(ValueError, match="at least the model's 2 blocks"):
        deepen(model, 1)
    with pytest.raises(TypeError, match="layers must be an int"):
        deepen(model, 4.0)


def test_train_cli_grows_the_init_model(tmp_path):
    from sparsevid_lab.cli import main

    model = _two_layer_tiny()
    export_builtin(model, tmp_path / "init", dtype=torch.float32)
    assert main(["train", "--out", str(tmp_path / "grown"), "--init", str(tmp_path / "init"), "--grow-to-layers", "3",
                 "--max-steps", "1", "--batch-size", "2", "--warmup", "1", "--sample-steps", "1"]) == 0
    grown = load_builtin(tmp_path / "grown")
    assert len(grown.transformer.blocks) == 3
    assert grown.config["phases"][-1]["arguments"]["grow_to_layers"] == 3
    assert main(["train", "--out", str(tmp_path / "x"), "--tiny", "--grow-to-layers", "3", "--max-steps", "1"]) != 0
