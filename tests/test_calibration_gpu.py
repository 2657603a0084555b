"""Per-head budgets on a CUDA GPU (skipped without CUDA): the Triton predictor with per-head budgets adds no
synchronising CUDA operation to prediction + attention, and after its first call runs the scalar plan's kernels and
no host-to-device copy (eager and inductor-compiled); compiled with mode="reduce-overhead" it matches eager; its
per-head masks are the scalar masks of each head, and a tiny Wan with a per-head configuration compiled by inductor
(fullgraph) matches eager."""
from __future__ import annotations

from collections import Counter

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


def _device_work(fn, calls: int = 3) -> Counter:
    """{name: count} of the CUDA kernels and copies ``calls`` calls of ``fn`` run, after a first call."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return Counter({event.key: event.count for event in prof.key_averages() if event.device_time_total > 0})


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "inductor"])
def test_per_head_calls_run_the_scalar_calls_device_work_and_copy_nothing_to_the_device(compiled):
    q, k, v = _qkv()
    torch.compiler.reset()

    def call(config):
        runtime = LayerRuntime(0, config)
        fn = lambda: sv.block_sparse_attention(q, k, v, runtime.mask(q, k, None))  # noqa: E731
        return torch.compile(fn, fullgraph=True) if compiled else fn

    scalar = _device_work(call(sv.SparseConfig(rule="hybrid", topk=0.05, topp=0.5, backend="triton")))
    per_head = _device_work(call(sv.SparseConfig(rule="hybrid", topk=[0.05] * 4, topp=[0.5] * 4, backend="triton")))
    torch.compiler.reset()
    assert per_head == scalar and sum(scalar.values()) > 0
    assert not [name for name in per_head if "HtoD" in name]


def test_per_head_prediction_under_reduce_overhead_matches_eager():
    """The per-head op runs outside the CUDA graphs (it keeps its budgets on the device between calls); the
    attention around it is replayed, and every call gives the eager output."""
    q, k, v = _qkv()
    runtime = LayerRuntime(0, sv.SparseConfig(rule="hybrid", backend="triton", **BUDGETS))

    def attend(q, k, v):
        mask = runtime.mask(q, k, None)
        return mask.keep, sv.block_sparse_attention(q, k, v, mask)

    keep, out = attend(q, k, v)
    torch.compiler.reset()
    compiled = torch.compile(attend, mode="reduce-overhead", fullgraph=True)
    calls = [tuple(t.clone() for t in compiled(q, k, v)) for _ in range(4)]
    torch.compiler.reset()
    for compiled_keep, compiled_out in calls:
        assert torch.equal(compiled_keep, keep)
        torch.testing.assert_close(compiled_out, out)


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
