"""Family-specific behaviour beyond the integration tests every tiny family runs (``tiny_models.MODELS``)."""
import itertools
from types import SimpleNamespace

import pytest
import torch

import sparsevid as sv
from sparsevid.integration.adapters import adapter_for
from sparsevid.integration.joint_attention import TokenLayout, text_key_sets

diffusers = pytest.importorskip("diffusers")
from tiny_models import build, relative_error, run_model  # noqa: E402

SMALL_BLOCKS = {"block_q": 64, "block_k": 64}


def test_families_sparse_attention_cannot_serve_are_refused_with_the_reason():
    sana = diffusers.SanaVideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8, num_layers=1,
        num_cross_attention_heads=2, cross_attention_head_dim=8, cross_attention_dim=16, caption_channels=16,
        sample_size=8, patch_size=(1, 2, 2))
    with pytest.raises(TypeError, match="linear attention"):
        sv.apply_sparse_attention(sana)
    latte = diffusers.LatteTransformer3DModel(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=8, num_layers=1,
        cross_attention_dim=16, sample_size=8, patch_size=2, caption_channels=16, video_length=2)
    with pytest.raises(TypeError, match="factorised"):
        sv.apply_sparse_attention(latte)
    animate2 = diffusers.WanAnimate2Transformer3DModel(
        patch_size=(1, 2, 2), text_len=8, in_dim=8, dim=16, ffn_dim=32, freq_dim=16, text_dim=16, out_dim=4,
        num_heads=2, num_layers=1)
    with pytest.raises(TypeError, match="BlockMask"):
        sv.apply_sparse_attention(animate2)


def test_ltx_without_the_token_grid_runs_sparse_in_raster_order():
    """LTX's condition pipeline passes video_coords [B, 3, N] instead of the grid: no tiling, still exact."""
    model, inputs = build("ltx")
    frames, height, width = (inputs.pop(name) for name in ("num_frames", "height", "width"))
    grid = torch.stack(torch.meshgrid(torch.arange(frames), torch.arange(height), torch.arange(width),
                                      indexing="ij")).flatten(1).float()
    inputs["video_coords"] = grid.expand(2, 3, -1) * torch.tensor([8.0, 32.0, 32.0])[:, None]
    del inputs["rope_interpolation_scale"]
    ref = run_model(model, inputs)
    sv.apply_sparse_attention(model, sv.SparseConfig(rule="topk", topk=1.0, **SMALL_BLOCKS), collect_stats=True)
    out = run_model(model, inputs)
    assert sv.forward_stats(model)["tile"] is None
    assert all(not s["dense"] for s in sv.attention_stats(model))
    assert relative_error(out, ref) < 1e-5


def test_a_per_row_mask_whose_video_rows_differ_is_refused():
    """HunyuanVideo 1.5's [B, 1, N, N] mask is read as one key-padding row; a mask that is not so is named."""
    layout = TokenLayout(video_start=0, video_len=6, total=9)
    valid = torch.tensor([True] * 6 + [True, True, False])
    pairwise = (valid[:, None] & valid[None, :])[None, None]
    keys = text_key_sets(pairwise, layout, batch=2)
    assert all(torch.equal(k, torch.tensor([0, 1])) for k in keys)
    skewed = pairwise.clone()
    skewed[0, 0, 3, 7] = False
    with pytest.raises(ValueError, match="differs between video rows"):
        text_key_sets(skewed, layout, batch=2)


def _mochi_text_mask():
    """Mochi's tiny batch with an empty prompt (no valid text token, as its pipeline's zeroed negative prompt) and a
    prompt with a hole (its processor then moves the valid text rows up)."""
    mask = torch.zeros(2, 12, dtype=torch.bool)
    mask[1, :9] = True
    mask[1, 3] = False
    return mask


def test_a_packed_batch_unpacks_each_entry_and_packs_valid_text_rows_first():
    from sparsevid.integration.packed_batch import PackedBatch

    packed = PackedBatch.of(torch.tensor([[1, 1, 0], [0, 1, 1]]), video_len=4)
    one = torch.randn(1, 2, 2 * 4 + 2 * 3, 5)  # [1, H, B*Nv + B*Nt, D]
    joint = packed.unpack(one)
    assert joint.shape == (2, 2, 7, 5)
    for b in range(2):
        assert torch.equal(joint[b, :, :4], one[0, :, 4 * b:4 * b + 4])
        assert torch.equal(joint[b, :, 4:], one[0, :, 8 + 3 * b:8 + 3 * b + 3])
    back = packed.pack(joint)
    assert torch.equal(back[:, :, :8], one[:, :, :8])
    text = back[0, :, 8:].unflatten(1, (2, 3))  # [H, B, Nt, D]
    assert torch.equal(text[:, 0, :2], one[0, :, 8:10]) and torch.equal(text[:, 1, :2], one[0, :, 12:14])
    assert not text[:, :, 2].any()  # each entry's padded row: zero
    with pytest.raises(TypeError, match="encoder_attention_mask"):
        PackedBatch.of(None, video_len=4)
    with pytest.raises(ValueError, match=r"\[B, Nt\]"):
        PackedBatch.of(torch.ones(2, 1, 3), video_len=4)
    with pytest.raises(ValueError, match="expected video"):
        packed.inputs(torch.randn(2, 5, 8), torch.randn(2, 3, 8))
    with pytest.raises(ValueError, match="its own text mask"):
        packed.attend(torch.nn.functional.scaled_dot_product_attention, one, one, one, torch.ones(1, 1, 14, 14) > 0)


def test_mochi_batch_with_different_text_lengths_equals_each_entry_alone():
    model, inputs = build("mochi")
    sv.apply_sparse_attention(model, sv.SparseConfig(rule="topk", topk=0.4, **SMALL_BLOCKS), collect_stats=True)
    for text_mask in (inputs["encoder_attention_mask"], _mochi_text_mask()):
        batch = {**inputs, "encoder_attention_mask": text_mask}
        both = run_model(model, batch)
        assert all(0.3 < s["sparsity"] for s in sv.attention_stats(model))
        for b in range(2):
            alone = run_model(model, {k: v[b:b + 1] for k, v in batch.items()})
            assert relative_error(both[b:b + 1], alone) < 1e-5


def test_mochi_attention_with_every_tile_kept_gives_the_stock_video_and_text_outputs():
    """Every layer's attention outputs, text included: valid text rows moved up as the stock processor moves them,
    padded rows zero (then the output projection's bias)."""
    model, inputs = build("mochi")
    inputs["encoder_attention_mask"] = _mochi_text_mask()
    outputs = []
    for block in model.transformer_blocks:
        block.attn1.register_forward_hook(lambda module, args, out: outputs.append(out))
    run_model(model, inputs)
    stock, outputs[:] = list(outputs), []
    sv.apply_sparse_attention(model, sv.SparseConfig(rule="topk", topk=1.0, tile="none", **SMALL_BLOCKS))
    run_model(model, inputs)
    assert len(outputs) == len(stock) == 3
    for (video, text), (stock_video, stock_text) in zip(outputs, stock):
        assert relative_error(video, stock_video) < 1e-5 and relative_error(text, stock_text) < 1e-5
        assert torch.equal(text[0], stock_text[0])  # the empty prompt's rows: no attention output at all


def test_mochi_counts_steps_on_its_rising_timesteps_and_runs_dense_steps_as_stock(monkeypatch):
    """Mochi's pipeline passes timestep 1000 (1 - sigma), rising over the denoising: the steps count up and a smaller
    timestep starts a new generation; a dense step (stats on: the processor's own call per batch entry) is stock,
    its attention time spanning both entries' calls (a clock that ticks once per mark)."""
    from sparsevid.integration import stats as stats_module

    monkeypatch.setattr(stats_module, "time", SimpleNamespace(perf_counter=itertools.count().__next__))
    model, inputs = build("mochi")
    refs = {t: run_model(model, {**inputs, "timestep": torch.tensor([t, t])}) for t in (0, 250)}
    sv.apply_sparse_attention(model, sv.SparseConfig(rule="topk", topk=0.4, dense_steps=1, **SMALL_BLOCKS),
                              collect_stats=True)
    steps = []
    for t in (0, 0, 250, 600, 0):  # a guidance pass of the same step, two steps, a new generation
        out = run_model(model, {**inputs, "timestep": torch.tensor([t, t])})
        steps.append(sv.denoising_step(model))
        stats = sv.attention_stats(model)
        assert all(s["dense"] == (steps[-1] == 0) for s in stats)
        if steps[-1] == 0:  # marks: start and end of entry 0's call, end of entry 1's
            assert all(s["attention_ms"] == 2e3 for s in stats)
        if t in refs:
            assert torch.equal(out, refs[t]) == (steps[-1] == 0)
    assert steps == [0, 0, 1, 2, 0]


@pytest.mark.parametrize("name", ["wan_animate", "easyanimate", "cosmos", "kandinsky5", "allegro", "ltx2",
                                  "kandinsky6", "hunyuan_video_framepack"])
def test_families_that_tile_per_layer_keep_the_forward_in_raster_order(name):
    model, inputs = build(name)
    assert not adapter_for(model).reorders_forward(model.config)
    sv.apply_sparse_attention(model, sv.SparseConfig(rule="topk", topk=0.4, **SMALL_BLOCKS), collect_stats=True)
    run_model(model, inputs)
    assert sv.forward_stats(model)["tile"] is None
    assert all(0.3 < s["sparsity"] and s["reorder_ms"] > 0 for s in sv.attention_stats(model))


@pytest.mark.parametrize("name, objective", [("consisid", "v_prediction"), ("cosmos", "edm"), ("allegro", "ddpm")])
def test_training_refuses_families_not_trained_by_flow_matching(name, objective):
    from sparsevid.training.velocity import check_flow_family

    model, _ = build(name)
    with pytest.raises(TypeError, match=objective):
        check_flow_family(model)


def test_the_diffusers_tests_plugin_makes_models_sparse_when_built_and_loaded(monkeypatch, tmp_path):
    """scripts/diffusers_model_tests.py as a pytest plugin: built and loaded transformers are sparse (every tile
    kept, so the stock outputs), a stock run changes nothing."""
    import pathlib

    from sparsevid.integration import adapters

    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).parents[1] / "scripts"))
    plugin = __import__("diffusers_model_tests")
    stand_in = type("WanTransformer3DModel", (diffusers.WanTransformer3DModel,), {})  # patched instead of diffusers'
    monkeypatch.setattr(diffusers, "WanTransformer3DModel", stand_in)
    monkeypatch.setattr(adapters, "ADAPTERS", tuple(a for a in adapters.ADAPTERS if a.name == "wan"))
    model, inputs = build("wan")
    ref = run_model(model, inputs)
    model.save_pretrained(tmp_path)
    monkeypatch.setenv(plugin.MODE_VARIABLE, "stock")
    plugin.pytest_configure(None)
    assert not sv.is_sparse(stand_in.from_pretrained(tmp_path))
    monkeypatch.setenv(plugin.MODE_VARIABLE, "sparse")
    plugin.pytest_configure(None)
    built = stand_in(**model.config)
    loaded = stand_in.from_pretrained(tmp_path)
    assert sv.is_sparse(built) and sv.is_sparse(loaded) and loaded.config.num_layers == model.config.num_layers
    assert relative_error(run_model(loaded, inputs), ref) < 1e-5
