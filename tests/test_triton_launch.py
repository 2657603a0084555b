"""Autotuned launches with the config chosen for their key (``sparsevid.ops.triton_launch``): the first call of a
key goes through the autotuner, later ones do not, and they give what the first did (Triton interpreter on the
CPU)."""
from __future__ import annotations

import pytest
import torch
from triton.runtime.autotuner import Autotuner

import sparsevid as sv
from oracles import DEVICE, rel_err


@pytest.fixture
def autotuner_calls(monkeypatch):
    """The autotuned kernels that go through their autotuner, in call order, starting from no chosen configs
    (other tests may already have launched the same keys)."""
    from sparsevid.ops import triton_launch

    monkeypatch.setattr(triton_launch, "_CHOSEN", {})
    calls, original = [], Autotuner.run

    def run(self, *args, **kwargs):
        calls.append(self.base_fn.__name__)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Autotuner, "run", run)
    return calls


def _heads(d: int, n: int) -> torch.Tensor:
    return torch.randn(1, 2, n, d, device=DEVICE)


def test_prediction_asks_the_autotuner_once_per_key(autotuner_calls):
    rule = dict(rule="hybrid", topk=0.2, topp=0.8, block_q=64, block_k=64, backend="triton")
    sv.predict_mask(_heads(16, 200), _heads(16, 333), **rule)
    autotuner_calls.clear()
    q, k = _heads(16, 200), _heads(16, 333)  # the same key, fresh values
    mask, stats = sv.predict_mask(q, k, **rule)
    assert autotuner_calls == []
    ref, ref_stats = sv.predict_mask(q, k, **{**rule, "backend": "reference"})
    assert torch.equal(mask.keep, ref.keep)
    assert torch.allclose(stats.kept_mass, ref_stats.kept_mass, atol=1e-5)
    sv.predict_mask(_heads(32, 200), _heads(32, 333), **rule)  # another head dim: another key
    assert sorted(autotuner_calls) == ["_logits_kernel", "_pool_kernel", "_select_kernel"]


def test_attention_reuses_its_config_and_the_descriptor_boxes(autotuner_calls):
    """d = 16 reads K and V through tensor descriptors, whose boxes the config's pre-hook sets on every call."""
    n = 333
    mask = sv.random_block_mask(1, 2, n, n, 0.5, 64, 64, device=DEVICE)
    sv.block_sparse_attention(_heads(16, n), _heads(16, n), _heads(16, n), mask, backend="triton")
    autotuner_calls.clear()
    q, k, v = _heads(16, n), _heads(16, n), _heads(16, n)
    out = sv.block_sparse_attention(q, k, v, mask, backend="triton")
    assert autotuner_calls == []
    ref = sv.block_sparse_attention(*(t.double() for t in (q, k, v)), mask, backend="reference")
    assert rel_err(out, ref) < 1e-4
    sv.block_sparse_attention(_heads(16, 300), _heads(16, 300), _heads(16, 300),
                              sv.random_block_mask(1, 2, 300, 300, 0.5, 64, 64, device=DEVICE), backend="triton")
    assert autotuner_calls == ["_bsa_fwd_kernel"]  # N is part of the key
