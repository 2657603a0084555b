"""apply / remove on the tiny transformer of every supported family, built from configs (float32, CPU)."""
import importlib.util

import pytest
import torch

import sparsevid as sv
from sparsevid.integration.adapters import adapter_for
from sparsevid.integration.joint_attention import TokenLayout, TokenOrder, joint_sparse_attention, text_key_sets
from sparsevid.ops import random_block_mask
from sparsevid.ops.mask import expand_block_mask

pytest.importorskip("diffusers")
from tiny_models import MODELS, VIDEO_TOKENS, build as _build, relative_error, run_model  # noqa: E402

SMALL_BLOCKS = {"block_q": 64, "block_k": 64}


def _processors(model):
    return [attn.processor for attn in adapter_for(model).self_attentions(model)]


@pytest.mark.parametrize("tile", ["auto", "none"])
@pytest.mark.parametrize("name", list(MODELS))
def test_keeping_every_tile_matches_the_original(name, tile):
    model, inputs = _build(name)
    ref = run_model(model, inputs)
    sv.apply_sparse_attention(model, sv.SparseConfig(rule="topk", topk=1.0, tile=tile, **SMALL_BLOCKS),
                              collect_stats=True)
    out = run_model(model, inputs)
    stats = sv.attention_stats(model)
    assert len(stats) == len(adapter_for(model).self_attentions(model))
    assert all(not s["dense"] and s["sparsity"] == 0.0 for s in stats)
    assert torch.isfinite(out).all()
    assert relative_error(out, ref) < 1e-5


@pytest.mark.parametrize("name", list(MODELS))
def test_remove_restores_the_same_processors_and_outputs(name):
    model, inputs = _build(name)
    before = _processors(model)
    ref = run_model(model, inputs)
    sv.apply_sparse_attention(model, sv.SparseConfig(rule="topk", topk=0.3, **SMALL_BLOCKS))
    assert sv.is_sparse(model)
    assert all(type(p).__name__ == "SparseAttnProcessor" for p in _processors(model))
    sparse = run_model(model, inputs)
    sv.remove_sparse_attention(model)
    assert not sv.is_sparse(model)
    assert all(a is b for a, b in zip(_processors(model), before))
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    assert torch.equal(run_model(model, inputs), ref)
    assert relative_error(sparse, ref) > 1e-3


@pytest.mark.parametrize("name", list(MODELS))
def test_sparse_run_reports_sparsity_and_timings(name):
    model, inputs = _build(name)
    sv.apply_sparse_attention(model, sv.SparseConfig(rule="topk", topk=0.3, **SMALL_BLOCKS), collect_stats=True)
    out = run_model(model, inputs)
    assert torch.isfinite(out).all()
    stats = sv.attention_stats(model)
    assert [s["layer"] for s in stats] == list(range(len(stats)))
    for s in stats:
        assert 0.3 < s["sparsity"] < 1.0
        assert s["attention_ms"] > 0 and s["predict_ms"] >= 0
        assert s["video_tokens"] == VIDEO_TOKENS[name]


def test_dense_layers_and_dense_steps_follow_the_denoising_step():
    model, inputs = _build("wan")
    ref = run_model(model, inputs)
    cfg = sv.SparseConfig(rule="topk", topk=0.3, dense_layers=(0,), dense_steps=1, **SMALL_BLOCKS)
    sv.apply_sparse_attention(model, cfg, collect_stats=True)
    first = run_model(model, inputs)  # step 0: dense warm-up, exactly the original
    assert sv.denoising_step(model) == 0
    assert [s["dense"] for s in sv.attention_stats(model)] == [True, True, True]
    assert torch.allclose(first, ref, rtol=0, atol=0)
    run_model(model, {**inputs, "timestep": torch.tensor([500])})
    assert sv.denoising_step(model) == 1
    assert [s["dense"] for s in sv.attention_stats(model)] == [True, False, False]
    sv.reset_denoising_step(model)
    run_model(model, {**inputs, "timestep": torch.tensor([300])})
    assert sv.denoising_step(model) == 0


def test_hunyuan_batch_with_different_text_padding_equals_each_sample_alone():
    model, inputs = _build("hunyuan_video")
    sv.apply_sparse_attention(model, sv.SparseConfig(rule="topk", topk=0.4, **SMALL_BLOCKS))
    both = run_model(model, inputs)
    for b in range(2):
        alone = run_model(model, {k: v[b:b + 1] for k, v in inputs.items()})
        assert relative_error(both[b:b + 1], alone) < 1e-5


def test_joint_core_matches_a_dense_masked_reference():
    """Video rows: kept video tiles (in the given token order) + valid text keys; text rows: all valid keys."""
    torch.manual_seed(1)
    batch, heads, video, text, dim = 2, 3, 200, 9, 16
    layout = TokenLayout(video_start=text, video_len=video, total=video + text)  # text first
    q, k, v = (torch.randn(batch, heads, layout.total, dim, dtype=torch.float64) for _ in range(3))
    key_mask = torch.ones(batch, layout.total, dtype=torch.bool)
    key_mask[0, 6:text] = False
    key_mask[1, 2:4] = False
    attn_mask = key_mask[:, None, None, :]
    perm = torch.randperm(video)
    order = TokenOrder(perm, torch.argsort(perm))
    mask = random_block_mask(batch, heads, video, video, sparsity=0.6, block_q=64, block_k=64)
    out, tile_mass = joint_sparse_attention(q, k, v, layout, mask, order, backend="reference", attn_mask=attn_mask,
                                            key_sets=text_key_sets(attn_mask, layout, batch))
    assert tile_mass is None
    # Dense reference in the original token order.
    allowed = key_mask[:, None, None, :].expand(batch, heads, layout.total, layout.total).clone()
    tiled_allowed = expand_block_mask(mask).expand(batch, heads, video, video)
    video_idx = torch.arange(text, layout.total)
    vv = torch.zeros(batch, heads, video, video, dtype=torch.bool)
    vv[:, :, perm[:, None], perm[None, :]] = tiled_allowed
    allowed[:, :, video_idx[:, None], video_idx[None, :]] = vv
    scores = (q @ k.transpose(-1, -2) * dim ** -0.5).masked_fill(~allowed, float("-inf"))
    ref = torch.softmax(scores, dim=-1) @ v
    assert relative_error(out, ref) < 1e-10


def test_errors_name_the_problem():
    model, inputs = _build("wan")
    with pytest.raises(TypeError, match="not supported"):
        sv.apply_sparse_attention(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="config"):
        sv.apply_sparse_attention(model, {"topk": 0.1})
    with pytest.raises(ValueError, match="dense_layers"):
        sv.apply_sparse_attention(model, sv.SparseConfig(dense_layers=(3,)))
    with pytest.raises(ValueError, match="layer_overrides"):
        sv.apply_sparse_attention(model, sv.SparseConfig(layer_overrides={7: {"topk": 0.5}}))
    with pytest.raises(ValueError, match="not applied"):
        sv.remove_sparse_attention(model)
    sv.apply_sparse_attention(model)
    with pytest.raises(ValueError, match="collect_stats"):
        sv.attention_stats(model)


def test_apply_twice_replaces_the_config_and_remove_still_restores():
    model, inputs = _build("cogvideox")
    before = _processors(model)
    sv.apply_sparse_attention(model, sv.SparseConfig(rule="topk", topk=0.3, **SMALL_BLOCKS))
    sv.apply_sparse_attention(model, sv.SparseConfig(rule="topk", topk=1.0, **SMALL_BLOCKS))
    assert all(p.original is b for p, b in zip(_processors(model), before))
    sv.remove_sparse_attention(model)
    assert all(a is b for a, b in zip(_processors(model), before))


@pytest.mark.parametrize("name", list(MODELS))
def test_saved_and_loaded_transformer_keeps_working_with_apply(name, tmp_path):
    model, inputs = _build(name)
    if model._keep_in_fp32_modules and importlib.util.find_spec("accelerate") is None:
        pytest.skip(f"diffusers loads {type(model).__name__} only with accelerate installed")
    cfg = sv.SparseConfig(rule="topk", topk=0.4, **SMALL_BLOCKS)
    sv.apply_sparse_attention(model, cfg)
    sparse = run_model(model, inputs)
    model.save_pretrained(tmp_path)  # saved while patched: weights and config only
    loaded = type(model).from_pretrained(tmp_path).eval()
    assert not sv.is_sparse(loaded)
    sv.remove_sparse_attention(model)
    assert torch.equal(run_model(loaded, inputs), run_model(model, inputs))
    sv.apply_sparse_attention(loaded, sv.SparseConfig.from_json(cfg.to_json()))
    assert torch.allclose(run_model(loaded, inputs), sparse, rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", list(MODELS))
def test_gradients_with_every_tile_kept_match_the_original(name):
    model, inputs = _build(name)

    def grads():
        model.zero_grad()
        model(**inputs, return_dict=False)[0].square().mean().backward()
        return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    ref = grads()
    sv.apply_sparse_attention(model, sv.SparseConfig(rule="topk", topk=1.0, **SMALL_BLOCKS))
    got = grads()
    # One relative error over all parameters: some (e.g. key biases) have gradients that are rounding noise.
    assert got.shape == ref.shape and relative_error(got, ref) < 1e-5


def test_set_attention_backend_after_apply_reaches_the_dense_attentions(monkeypatch):
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    model, inputs = _build("wan")  # 3 blocks: each a self-attention and a (dense) cross-attention
    sv.apply_sparse_attention(model, sv.SparseConfig(rule="topk", topk=0.5, dense_layers=(0,), **SMALL_BLOCKS))
    backends = _AttentionBackendRegistry._backends
    math = backends[AttentionBackendName._NATIVE_MATH]
    calls = []

    def counted(*args, **kwargs):
        calls.append(kwargs["query"].shape)
        return math(*args, **kwargs)

    monkeypatch.setitem(backends, AttentionBackendName._NATIVE_MATH, counted)
    monkeypatch.setattr(_AttentionBackendRegistry, "_active_backend", _AttentionBackendRegistry._active_backend)
    model.set_attention_backend("_native_math")
    assert all(p.original._attention_backend == AttentionBackendName._NATIVE_MATH for p in _processors(model))
    run_model(model, inputs)
    # The dense self-attention of layer 0 and the three cross-attentions; the sparse layers run sparse.
    assert len(calls) == 4
    assert sum(shape[1] == VIDEO_TOKENS["wan"] for shape in calls) == 1 + 3  # queries: video tokens


def test_remove_keeps_processors_set_after_apply_and_says_so():
    from diffusers.models.transformers.transformer_wan import WanAttnProcessor

    model, inputs = _build("wan")
    attentions = adapter_for(model).self_attentions(model)
    originals = _processors(model)
    sv.apply_sparse_attention(model, sv.SparseConfig(rule="topk", topk=0.5, **SMALL_BLOCKS))
    mine = WanAttnProcessor()
    attentions[1].set_processor(mine)
    assert sv.is_sparse(model)
    with pytest.warns(UserWarning, match=r"layers \[1\].*restored 2 of 3"):
        sv.remove_sparse_attention(model)
    assert _processors(model) == [originals[0], mine, originals[2]]
    assert not sv.is_sparse(model)
    # A transformer whose sparse processors were all replaced is not sparse any more.
    sv.apply_sparse_attention(model, sv.SparseConfig(rule="topk", topk=0.5, **SMALL_BLOCKS))
    for attn in attentions:
        attn.set_processor(WanAttnProcessor())
    assert not sv.is_sparse(model)


def test_skyreels_diffusion_forcing_keeps_its_per_frame_timesteps():
    """SkyReels-V2 under diffusion forcing (a noise level per frame) with every tile kept equals the stock model:
    its layers tile their own q, k, v, so the per-token timestep tensors stay in raster order."""
    model, inputs = _build("skyreels_v2")
    inputs = {**inputs, "timestep": torch.tensor([[900, 700, 500, 300]]), "enable_diffusion_forcing": True}
    ref = run_model(model, inputs)
    sv.apply_sparse_attention(model, sv.SparseConfig(rule="topk", topk=1.0, block_q=64, block_k=64),
                              collect_stats=True)
    assert relative_error(run_model(model, inputs), ref) < 1e-5
    assert sv.forward_stats(model)["tile"] is None  # the forward stays in raster order
    sv.apply_sparse_attention(model, sv.SparseConfig(rule="topk", topk=0.5, block_q=64, block_k=64))
    assert relative_error(run_model(model, inputs), ref) > 1e-4
    causal, causal_inputs = _build("skyreels_v2", num_frame_per_block=2)
    sv.apply_sparse_attention(causal, sv.SparseConfig(rule="topk", topk=0.5, block_q=64, block_k=64))
    with pytest.raises(ValueError, match="attention mask over video tokens"):
        run_model(causal, causal_inputs)
