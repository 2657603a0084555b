"""Per-head budgets on a CUDA GPU (skipped without CUDA): the Triton predictor with per-head budgets adds no
synchronising CUDA operation to prediction + attention, its per-head masks are the scalar masks of each head, and a
tiny Wan with a per-head configuration compiled by inductor (fullgraph) matches eager."""
from __future__ import annotations

import pytest
import torch

import sparsevid as sv
from sparsevid.plan import LayerRuntime

pytestmark = pytest.mark.gpu
pytest.importorskip("diffusers")
from test_runtime_gpu import synchronising_calls  # noqa: E402
from tiny_models import build  # noqa: E402

BUDGETS = {"topk": [0.05, 0.2, 1e-6, 1.0], "topp": [1e-6, 1e-6, 0.8, 1.0]}


def _qkv():
    return (torch.randn(1, 32760, 4, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in range(3))


def test_per_head_prediction_and_attention_do_not_synchronise():
    q, k, v = _qkv()
    runtime = LayerRuntime(0, sv.SparseConfig(rule="hybrid", backend="triton", **BUDGETS))

    def call():
        sv.block_sparse_attention(q, k, v, runtime.mask(q, k, None))

    call()
    assert synchronising_calls(call) == []


def test_triton_per_head_masks_are_each_heads_scalar_mask():
    q, k, _ = _qkv()
    keep = LayerRuntime(0, sv.SparseConfig(rule="hybrid", backend="triton", **BUDGETS)).mask(q, k, None).keep
    for head, (topk, topp) in enumerate(zip(BUDGETS["topk"], BUDGETS["topp"])):
        scalar = LayerRuntime(0, sv.SparseConfig(rule="hybrid", topk=topk, topp=topp, backend="triton"))
        assert torch.equal(keep[:, head], scalar.mask(q[:, head:head + 1], k[:, head:head + 1], None).keep[:, 0])


def test_inductor_compiled_per_head_wan_matches_eager():
    model, inputs = build("wan", num_attention_heads=4)
    model = model.to("cuda", torch.float16)
    inputs = {name: value.to("cuda", torch.float16) if value.is_floating_point() else value.to("cuda")
              for name, value in inputs.items()}
    config = sv.SparseConfig(rule="hybrid", block_q=64, block_k=64, backend="triton",
                             layer_overrides={layer: dict(BUDGETS) for layer in (0, 2)})
    sv.apply_sparse_attention(model, config)
    with torch.no_grad():
        eager = model(**inputs, return_dict=False)[0]
        compiled = torch.compile(model, fullgraph=True)
        with torch._dynamo.config.patch(error_on_recompile=True):
            outs = [compiled(**{**inputs, "timestep": torch.tensor([t], device="cuda")}, return_dict=False)[0]
                    for t in (700, 700, 500)]
    # fp16: inductor fuses the projections differently (as the scalar configuration's test allows).
    assert float((outs[0].float() - eager.float()).norm() / eager.float().norm()) < 1e-2
