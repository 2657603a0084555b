"""Host synchronisation on a CUDA GPU (skipped without CUDA): the public prediction + attention calls, the step
bookkeeping and the sparse transformer's inference and training forwards add no synchronising CUDA operation.

Counted with ``torch.cuda.set_sync_debug_mode("warn")``, which warns at every synchronising call (a host read, a
copy from pageable host memory, ...). Each case runs once first, so that autotuning and caches are warm. Last,
a sparse Wan compiled with mode="reduce-overhead" keeps its CUDA graphs and matches eager.
"""
from __future__ import annotations

import warnings

import pytest
import torch

import sparsevid as sv

pytestmark = pytest.mark.gpu
pytest.importorskip("diffusers")
from tiny_models import build  # noqa: E402

CONFIG = dict(rule="topk", topk=0.5, block_q=64, block_k=64, backend="triton")


def synchronising_calls(fn) -> list[str]:
    """The synchronising CUDA operations ``fn()`` makes, as "file:line: message" of the Python line that made
    each (so that a failure names the call to fix)."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    # torch's own notice that the debug mode is a prototype also says "synchronizing"; only the per-call
    # warnings say "called a synchronizing CUDA operation".
    return [f"{w.filename}:{w.lineno}: {w.message}" for w in caught
            if "called a synchronizing CUDA operation" in str(w.message)]


def test_the_counter_catches_a_host_read():
    assert len(synchronising_calls(lambda: torch.ones(4, device="cuda").sum().item())) == 1


def test_predict_and_attend_through_the_public_api_do_not_synchronise():
    q, k, v = (torch.randn(1, 32760, 12, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in range(3))

    def call():
        mask, _ = sv.predict_mask(q, k, rule="topk", topk=0.05)
        sv.block_sparse_attention(q, k, v, mask)

    call()
    assert synchronising_calls(call) == []


def test_step_bookkeeping_does_not_synchronise():
    model, _ = build("wan")
    sv.apply_sparse_attention(model.cuda(), sv.SparseConfig(**CONFIG))
    assert synchronising_calls(lambda: (sv.reset_denoising_step(model), sv.set_denoising_step(model, 2),
                                        sv.set_denoising_step(model, None))) == []


def _cuda_model(config: dict | None, checkpointing: bool):
    model, inputs = build("wan", attention_head_dim=32)
    model.cuda()
    inputs = {name: value.cuda() for name, value in inputs.items()}
    if config is not None:
        sv.apply_sparse_attention(model, sv.SparseConfig(**config))
    if checkpointing:
        model.train()
        model.enable_gradient_checkpointing()
    return model, inputs


@pytest.mark.parametrize("config, step_reads", [(CONFIG, 0), ({**CONFIG, "dense_steps": 1, "refresh_interval": 2}, 1)],
                         ids=["constant", "step-dependent"])
def test_an_inference_forward_synchronises_no_more_than_the_dense_model(config, step_reads):
    """A configuration that varies with the step reads the step once per forward (docs/integration.md);
    a constant one reads nothing."""
    calls = []
    for sparse in (None, config):
        model, inputs = _cuda_model(sparse, checkpointing=False)
        with torch.no_grad():
            model(**inputs, return_dict=False)
            calls.append(synchronising_calls(lambda: model(**inputs, return_dict=False)))
    dense, sparse = calls
    assert len(sparse) <= len(dense) + step_reads, (sparse, dense)


@pytest.mark.parametrize("config", [CONFIG, {**CONFIG, "refresh_interval": 2}], ids=["constant", "reuse"])
def test_a_checkpointed_training_step_synchronises_no_more_than_the_dense_model(config):
    calls = []
    for sparse in (None, config):
        model, inputs = _cuda_model(sparse, checkpointing=True)

        def step():
            if sparse is not None:
                sv.reset_denoising_step(model)  # as the distillation loop does before every forward
            model(**inputs, return_dict=False)[0].square().mean().backward()

        step()
        calls.append(synchronising_calls(step))
    dense, sparse = calls
    assert len(sparse) <= len(dense), (sparse, dense)


def test_reduce_overhead_compiles_a_sparse_wan_into_cuda_graphs_that_match_eager():
    """mode="reduce-overhead": inductor keeps its CUDA graphs (no skip: nothing on the host, no CPU tensor in
    the graph) and the replays give the eager outputs, across denoising steps."""
    from torch._dynamo.utils import counters

    model, inputs = _cuda_model(CONFIG, checkpointing=False)
    steps = [{**inputs, "timestep": torch.tensor([t], device="cuda")} for t in (700, 700, 500, 300)]
    with torch.no_grad():
        eager = [model(**step, return_dict=False)[0] for step in steps]
        sv.reset_denoising_step(model)
        torch._dynamo.reset()
        counters.clear()
        compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
        outs = [compiled(**step, return_dict=False)[0].clone() for step in steps]
    assert counters["inductor"]["cudagraph_skips"] == 0
    for out, ref in zip(outs, eager):
        assert float((out - ref).norm() / ref.norm()) < 1e-4  # float32 throughout
    torch._dynamo.reset()
