"""SparseConfig(precision="fp8"): the setting round-trips and overrides per layer, what the FP8 forward cannot do is
refused by name, and a tiny Wan runs its sparse attentions through the FP8 emulation (CPU, reference backend)."""
import pytest
import torch

import sparsevid as sv
from sparsevid.integration import joint_attention
from sparsevid.ops import fp8_reference
from oracles import rel_err


def test_precision_round_trips_and_overrides_per_layer():
    cfg = sv.SparseConfig(precision="fp8", backend="reference", layer_overrides={1: {"precision": "native"}})
    back = sv.SparseConfig.from_json(cfg.to_json())
    assert back == cfg and cfg.to_dict()["precision"] == "fp8"
    assert [back.plan(layer, None).precision for layer in range(3)] == ["fp8", "native", "fp8"]
    assert sv.SparseConfig().precision == "native"
    one = sv.SparseConfig(layer_overrides={2: {"precision": "fp8", "backend": "triton"}})
    assert [one.plan(layer, None).precision for layer in range(3)] == ["native", "native", "fp8"]


@pytest.mark.parametrize("kwargs, error, match", [
    ({"precision": "fp16"}, ValueError, r"precision must be one of \('native', 'fp8', 'int8'\)"),
    ({"precision": True}, ValueError, "precision must be one of"),
    ({"precision": "fp8", "backend": "flex"}, ValueError, "precision='fp8' runs on the backends .* got backend='flex'"),
    ({"precision": "fp8", "backend": "gather"}, ValueError, "got backend='gather'"),
    ({"precision": "fp8", "refresh_search": "exact"}, ValueError, "refresh_search='exact' needs precision='native'"),
    ({"layer_overrides": {2: {"precision": "fp8", "backend": "flex"}}}, ValueError,
     r"layer_overrides\[2\]\.precision='fp8' runs on"),
    ({"precision": "fp8", "layer_overrides": {0: {"refresh_search": "exact"}}}, ValueError,
     r"layer_overrides\[0\]\.precision='fp8' cannot refresh"),
], ids=["fp16", "bool", "flex", "gather", "exact-refresh", "override-backend", "override-refresh"])
def test_what_fp8_cannot_do_is_refused_by_name(kwargs, error, match):
    with pytest.raises(error, match=match):
        sv.SparseConfig(**kwargs)


def _tiny_wan():
    pytest.importorskip("diffusers")
    from tiny_models import build

    return build("wan", attention_head_dim=32)  # the FP8 products need a head dim that is a multiple of 16, >= 32


def _record_calls(monkeypatch):
    """Wrap the block-sparse attention the sparse processors call; returns the list of (q, k, v, mask, precision,
    out) each call made."""
    calls = []
    original = joint_attention.block_sparse_attention

    def recording(q, k, v, mask, **kwargs):
        out = original(q, k, v, mask, **kwargs)
        calls.append((q, k, v, mask, kwargs.get("precision", "native"), out))
        return out

    monkeypatch.setattr(joint_attention, "block_sparse_attention", recording)
    return calls


def test_tiny_wan_attends_through_the_fp8_emulation(monkeypatch):
    """Every sparse attention of the model gets precision='fp8' and returns the emulation's output, within the
    emulation's budget of float64 attention on the same inputs (3x one tensor's rounding error, as in
    test_fp8_attention.py); the model's output moves from the native sparse model's by less than one attention's
    FP8 error and by more than float32 rounding."""
    model, inputs = _tiny_wan()
    settings = dict(rule="topk", topk=0.5, block_q=64, block_k=64, backend="reference")
    sv.apply_sparse_attention(model, sv.SparseConfig(**settings))
    with torch.no_grad():
        native = model(**inputs, return_dict=False)[0]
    sv.apply_sparse_attention(model, sv.SparseConfig(precision="fp8", **settings))
    calls = _record_calls(monkeypatch)
    with torch.no_grad():
        fp8 = model(**inputs, return_dict=False)[0]
    assert len(calls) == 3 and all(precision == "fp8" for *_, precision, _ in calls)  # one per layer
    for q, k, v, mask, _, out in calls:
        scale = q.shape[-1] ** -0.5
        assert torch.equal(out, fp8_reference.fp8_reference_attention(q, k, v, mask, scale)[0])
        x = fp8_reference.quantize_fp8(q, k, v, mask.block_q, mask.block_k)
        eps = rel_err(x.v8.double() * x.v_scale[:, :, None], v)
        ref = sv.block_sparse_attention(q.double(), k.double(), v.double(), mask, backend="reference")
        assert rel_err(out, ref) <= 3 * eps
    assert 1e-4 < rel_err(fp8, native) < 3 * eps


def test_tiny_wan_refuses_what_fp8_cannot_run(monkeypatch):
    """Off CUDA, backend='auto' with fp8 raises instead of running the slow emulation; a forward that builds a
    graph for gradients raises (the FP8 forward has no backward)."""
    model, inputs = _tiny_wan()
    sv.apply_sparse_attention(model, sv.SparseConfig(precision="fp8", rule="topk", topk=0.5, block_q=64, block_k=64))
    with torch.no_grad(), pytest.raises(ValueError, match="backend='auto' needs a CUDA GPU .* backend='reference'"):
        model(**inputs)
    sv.apply_sparse_attention(model, sv.SparseConfig(precision="fp8", backend="reference", rule="topk", topk=0.5,
                                                     block_q=64, block_k=64))
    with pytest.raises(ValueError, match="no backward"):
        model(**inputs)
