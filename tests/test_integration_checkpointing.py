"""Training forwards of a sparse transformer: gradient checkpointing with mask reuse, and no host read of the
device per forward."""
import pytest
import torch
from torch.overrides import TorchFunctionMode

import sparsevid as sv

pytest.importorskip("diffusers")
from tiny_models import build  # noqa: E402

REUSE = dict(rule="topk", topk=0.5, block_q=64, block_k=64, backend="reference", refresh_interval=2)


def _gradients(model, inputs):
    model.zero_grad()
    model(**inputs, return_dict=False)[0].square().mean().backward()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def test_gradient_checkpointing_with_mask_reuse_matches_the_plain_backward():
    model, inputs = build("wan")
    model.train()
    sv.apply_sparse_attention(model, sv.SparseConfig(**REUSE))
    plain = _gradients(model, inputs)
    model.enable_gradient_checkpointing()
    sv.reset_denoising_step(model)  # the same masks again: predicted at step 0 of a new generation
    checkpointed = _gradients(model, inputs)
    assert float((checkpointed - plain).norm() / plain.norm()) < 1e-5


class _HostReads(TorchFunctionMode):
    """Counts the calls that copy a tensor's value to the host, and the writes of a Python number into a tensor
    by indexing (on CUDA a host-to-device copy that waits for the device)."""

    READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__int__,
             torch.Tensor.__float__, torch.Tensor.cpu, torch.Tensor.numpy}

    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.READS or (func is torch.Tensor.__setitem__ and not isinstance(args[2], torch.Tensor)):
            self.reads.append(func.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("refresh_interval", [1, 2])
def test_a_training_forward_and_its_reset_read_nothing_from_the_device(refresh_interval):
    model, inputs = build("wan")
    model.train()
    sv.apply_sparse_attention(model, sv.SparseConfig(**{**REUSE, "refresh_interval": refresh_interval}))
    model(**inputs, return_dict=False)  # warm caches (token orders)
    for _ in range(2):
        with _HostReads() as host:
            sv.reset_denoising_step(model)  # a training loop calls it before every forward
            model(**inputs, return_dict=False)[0].square().mean().backward()
        assert host.reads == []
    assert sv.denoising_step(model) == 0


def test_pinning_the_step_writes_no_python_number_into_the_counter():
    model, inputs = build("wan")
    sv.apply_sparse_attention(model, sv.SparseConfig(**REUSE))
    with _HostReads() as host:
        sv.set_denoising_step(model, 3)
        model(**inputs, return_dict=False)
    assert host.reads == []
    assert sv.denoising_step(model) == 3
