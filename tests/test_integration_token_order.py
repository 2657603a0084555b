"""Once-per-forward 3D-tile token order: exactness, agreement with per-layer tiling, and no per-layer copies."""
import dataclasses
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import sparsevid as sv
from sparsevid.integration import adapters, processors
from sparsevid.integration.token_order import relative_order, reorder_tokens, tile_order
from sparsevid.ops.tiling import DEFAULT_TILE

pytest.importorskip("diffusers")
from tiny_models import MODELS, VIDEO_TOKENS, build, relative_error, run_model  # noqa: E402

# Families whose whole forward runs in tile order (the others tile inside each sparse layer).
def _tiles_whole_forward(name: str) -> bool:
    model, _ = build(name)
    return adapters.adapter_for(model).reorders_forward(model.config)


FORWARD_TILED = [name for name in MODELS if _tiles_whole_forward(name)]

SMALL_BLOCKS = {"block_q": 64, "block_k": 64}
GRIDS = {"wan": (4, 8, 10), "hunyuan_video": (3, 10, 10), "cogvideox": (4, 8, 10)}


def _per_layer_tiling(monkeypatch):
    """Make every adapter keep the forward in raster order, so each sparse layer tiles its own q, k, v."""
    monkeypatch.setattr(adapters, "ADAPTERS", tuple(dataclasses.replace(a, reorders_forward=lambda config: False)
                                                    for a in adapters.ADAPTERS))


def _record_masks(monkeypatch) -> list:
    """Record every video mask the sparse processors use (as a dense block map) from now on."""
    masks = []

    def attend(q, k, v, layout, mask, *args, **kwargs):
        masks.append(mask.to_dense())
        return joint_sparse_attention(q, k, v, layout, mask, *args, **kwargs)

    joint_sparse_attention = processors.joint_sparse_attention
    monkeypatch.setattr(processors, "joint_sparse_attention", attend)
    return masks


def test_relative_order_composes_tile_orders():
    grid = (3, 5, 7)
    x = torch.randn(2, 3 * 5 * 7, 4)
    orders = [None, tile_order(grid, "auto", x.device), tile_order(grid, (2, 2, 4), x.device)]

    def arrange(order):
        return x if order is None else x[:, order.perm]

    for current in orders:
        for wanted in orders:
            step = relative_order(current, wanted)
            moved = arrange(current) if step is None else arrange(current)[:, step.perm]
            assert torch.equal(moved, arrange(wanted))
            assert torch.equal(moved if step is None else moved[:, step.inverse], arrange(current))


def test_reorder_tokens_keeps_text_before_the_video_in_place():
    text, video = torch.randn(2, 3, 5), torch.randn(2, 10, 5)
    perm = torch.randperm(10)
    out = reorder_tokens(torch.cat([text, video], dim=1), 1, perm)
    assert torch.equal(out, torch.cat([text, video[:, perm]], dim=1))
    with pytest.raises(ValueError, match="latent grid"):
        reorder_tokens(video, 1, torch.arange(11))


@pytest.mark.parametrize("name", FORWARD_TILED)
def test_tiled_forward_with_every_tile_kept_equals_the_original(name):
    model, inputs = build(name)
    ref = run_model(model, inputs)
    sv.apply_sparse_attention(model, sv.SparseConfig(rule="topk", topk=1.0, **SMALL_BLOCKS), collect_stats=True)
    out = run_model(model, inputs)
    info = sv.forward_stats(model)
    assert info["tile"] == DEFAULT_TILE and info["reorder_ms"] > 0 and info["restore_ms"] > 0
    # In the forward's order already: no layer reorders its own q, k, v.
    assert all(s["video_tokens"] == VIDEO_TOKENS[name] for s in sv.attention_stats(model))
    assert relative_error(out, ref) < 2e-6


def test_tiled_forward_gradients_equal_the_original():
    model, inputs = build("wan")
    latents = inputs["hidden_states"].clone().requires_grad_(True)

    def grads():
        model.zero_grad()
        latents.grad = None
        model(**{**inputs, "hidden_states": latents}, return_dict=False)[0].square().mean().backward()
        params = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        return params, latents.grad.clone()

    ref_params, ref_latents = grads()
    sv.apply_sparse_attention(model, sv.SparseConfig(rule="topk", topk=1.0, **SMALL_BLOCKS), collect_stats=True)
    params, latent_grads = grads()
    assert sv.forward_stats(model)["tile"] == DEFAULT_TILE
    assert relative_error(params, ref_params) < 1e-5
    assert relative_error(latent_grads, ref_latents) < 1e-5


def test_dense_layers_in_a_tiled_forward_and_per_token_timesteps_stay_exact():
    """Wan2.2-style per-token timestep [B, N] follows the token order; a dense layer runs in tile order."""
    model, inputs = build("wan")
    inputs["timestep"] = torch.rand(1, VIDEO_TOKENS["wan"]) * 1000
    ref = run_model(model, inputs)
    sv.apply_sparse_attention(model, sv.SparseConfig(rule="topk", topk=1.0, dense_layers=(1,), **SMALL_BLOCKS),
                              collect_stats=True)
    out = run_model(model, inputs)
    assert sv.forward_stats(model)["tile"] == DEFAULT_TILE
    assert [s["dense"] for s in sv.attention_stats(model)] == [False, True, False]
    assert relative_error(out, ref) < 2e-6


def test_all_dense_step_runs_in_raster_order_bit_for_bit():
    model, inputs = build("wan")
    ref = run_model(model, inputs)
    sv.apply_sparse_attention(model, sv.SparseConfig(rule="topk", topk=0.3, dense_steps=1, **SMALL_BLOCKS),
                              collect_stats=True)
    assert torch.equal(run_model(model, inputs), ref)
    assert sv.forward_stats(model) == {"step": 0, "tile": None, "reorder_ms": 0.0, "restore_ms": 0.0}


@pytest.mark.parametrize("name", FORWARD_TILED)
def test_tiled_forward_equals_per_layer_tiling(name, monkeypatch):
    """Same masks and outputs (fp32 rounding) whether the forward or each layer puts tokens in tile order,
    including layers whose own tile differs from the forward's (raster, another tile)."""
    overrides = {1: {"tile": "none"}, 2: {"tile": (2, 4, 4)}}
    cfg = sv.SparseConfig(rule="topk", topk=0.4, layer_overrides=overrides, **SMALL_BLOCKS)
    model, inputs = build(name, **({"num_layers": 3} if name == "cogvideox" else {}))
    masks = _record_masks(monkeypatch)
    sv.apply_sparse_attention(model, cfg, collect_stats=True)
    tiled = run_model(model, inputs)
    assert sv.forward_stats(model)["tile"] == DEFAULT_TILE
    tiled_masks = list(masks)
    masks.clear()
    _per_layer_tiling(monkeypatch)
    sv.apply_sparse_attention(model, cfg, collect_stats=True)
    per_layer = run_model(model, inputs)
    assert sv.forward_stats(model)["tile"] is None
    assert len(tiled_masks) == len(masks) == len(sv.attention_stats(model))
    assert all(torch.equal(a, b) for a, b in zip(tiled_masks, masks))
    assert 0.3 < min(float(1 - m.float().mean()) for m in masks)
    assert relative_error(tiled, per_layer) < 1e-5


def test_hunyuan_token_replace_keeps_per_layer_tiling():
    """I2V token replace modulates the first frame by raster position: the forward stays in raster order."""
    model, inputs = build("hunyuan_video", image_condition_type="token_replace")
    ref = run_model(model, inputs)
    sv.apply_sparse_attention(model, sv.SparseConfig(rule="topk", topk=1.0, **SMALL_BLOCKS), collect_stats=True)
    out = run_model(model, inputs)
    assert sv.forward_stats(model)["tile"] is None
    assert relative_error(out, ref) < 2e-6


class _CopyCounter(TorchDispatchMode):
    """Counts copy-like aten ops on per-token tensors (a dim of ``tokens``), inside / outside self-attention."""

    OPS = {"index_select", "index_copy", "index_copy_", "index", "gather", "scatter", "index_put_", "clone",
           "copy_", "_to_copy", "cat"}

    def __init__(self, model, tokens: int):
        super().__init__()
        self.tokens, self.inside, self.counts = tokens, False, Counter()
        self.handles = []
        for attn in adapters.adapter_for(model).self_attentions(model):
            self.handles.append(attn.register_forward_pre_hook(lambda *_: setattr(self, "inside", True)))
            self.handles.append(attn.register_forward_hook(lambda *_: setattr(self, "inside", False)))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        written = args[0] if name.endswith("_") else out
        if name in self.OPS and any(isinstance(t, torch.Tensor) and self.tokens in t.shape
                                    for t in (written if isinstance(written, (tuple, list)) else [written])):
            self.counts["attention" if self.inside else "outside", name] += 1
        return out

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()
        return super().__exit__(*exc)


def _copies(model, inputs) -> Counter:
    with torch.no_grad(), _CopyCounter(model, VIDEO_TOKENS["wan"]) as counter:
        model(**inputs, return_dict=False)
    return counter.counts


def test_sparse_layers_add_no_copies_of_q_k_v_or_the_output():
    """Per layer, the sparse attention (triton kernels, interpreted on the CPU) copies nothing that the original
    processor does not (diffusers' RoPE writes); per forward, four gathers: patch embedding, RoPE cos and
    sin, output projection. The patch embedding gather replaces Wan's own copy to contiguous tokens."""
    model, inputs = build("wan", num_layers=2)
    dense = _copies(model, inputs)
    cfg = sv.SparseConfig(rule="topk", topk=0.4, backend="triton", **SMALL_BLOCKS)
    sv.apply_sparse_attention(model, cfg)
    run_model(model, inputs)  # warm the permutation cache
    sparse = _copies(model, inputs)
    inside = Counter({op: n for (where, op), n in sparse.items() if where == "attention"})
    assert inside == Counter({op: n for (where, op), n in dense.items() if where == "attention"})
    assert set(inside) <= {"copy_"}
    outside = Counter({op: n for (where, op), n in sparse.items() if where == "outside"})
    assert outside == Counter({"index_select": 4})
    assert dense["outside", "clone"] == 1


def test_forward_stats_errors_name_the_problem():
    model, inputs = build("wan")
    with pytest.raises(ValueError, match="not applied"):
        sv.forward_stats(model)
    sv.apply_sparse_attention(model)
    with pytest.raises(ValueError, match="stats are off"):
        sv.forward_stats(model)
    sv.set_collect_stats(model, True)
    with pytest.raises(ValueError, match="no forward"):
        sv.forward_stats(model)
