"""Shared test set-up. Without CUDA, Triton kernels run on the CPU through Triton's interpreter, switched
on here before any kernel module is imported, and tests marked ``gpu`` are skipped."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def nan_poisoned_outputs(monkeypatch):
    """Every output the attention kernels write (the tile-mass scratch too) starts as NaN (integers: their
    minimum), so an element they fail to write, or a slot read before it was written, shows up."""
    from sparsevid.ops import triton_attention

    original = triton_attention._alloc
    monkeypatch.setattr(triton_attention, "_alloc", lambda *a, **kw: _poison(original(*a, **kw)))


def _poison(t: torch.Tensor) -> torch.Tensor:
    """NaN, or for integer tensors their smallest value (which no quantizer writes: int8 spans [-127, 127])."""
    return t.fill_(float("nan") if t.is_floating_point() else torch.iinfo(t.dtype).min)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
