"""Mask-quality metrics against brute-force dense computations in float64."""
from __future__ import annotations

import pytest
import torch

import sparsevid as sv
from sparsevid.eval import attention_recall, cosine_similarity, relative_l1, sparse_output_error
from sparsevid.eval import metrics
from sparsevid.ops.mask import expand_block_mask


def brute_force_recall(q, k, mask, scale):
    probs = torch.softmax(q.double() @ k.double().mT * scale, dim=-1)
    return (probs * expand_block_mask(mask)).sum(-1).mean(-1)


@pytest.mark.parametrize("shape", [
    pytest.param((2, 3, 333, 200, 32, 128, 64), id="B2-N333-M200-128x64"),
    pytest.param((1, 2, 50, 70, 16, 64, 128), id="N-below-block"),
])
def test_recall_matches_float64_dense(shape, monkeypatch):
    torch.manual_seed(0)
    b, h, n, m, d, block_q, block_k = shape
    q, k = torch.randn(b, h, n, d) * 2, torch.randn(b, h, m, d) * 2
    keep = torch.rand(b, 1, -(-n // block_q), -(-m // block_k)) < 0.5  # broadcast over heads
    mask = sv.SparseMask.from_dense(keep, n, m, block_q, block_k)
    # A small chunk budget forces several query chunks.
    monkeypatch.setattr(metrics, "_MAX_CHUNK_ELEMENTS", b * h * m * block_q)
    got = attention_recall(q, k, mask, scale=0.2)
    want = brute_force_recall(q, k, mask, 0.2)
    assert got.shape == (b, h) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=0)  # fp32 scores, mass in [0, 1]
    got64 = attention_recall(q.double(), k.double(), mask, scale=0.2)
    torch.testing.assert_close(got64, want, atol=1e-12, rtol=0)


def test_recall_of_full_and_empty_masks():
    torch.manual_seed(1)
    q, k = torch.randn(1, 2, 200, 16), torch.randn(1, 2, 300, 16)
    full = sv.SparseMask.full(200, 300, 64, 64)
    empty = sv.SparseMask.from_dense(torch.zeros(1, 1, 4, 5, dtype=torch.bool), 200, 300, 64, 64)
    torch.testing.assert_close(attention_recall(q, k, full), torch.ones(1, 2), atol=1e-6, rtol=0)
    assert bool((attention_recall(q, k, empty) == 0).all())


def test_relative_l1_and_cosine():
    torch.manual_seed(2)
    ref = torch.randn(3, 50)
    out = ref + 0.1 * torch.randn(3, 50)
    r, o = ref.double(), out.double()
    assert relative_l1(out, ref) == pytest.approx(float((o - r).abs().sum() / r.abs().sum()), rel=1e-12)
    assert cosine_similarity(out, ref) == pytest.approx(float((o * r).sum() / (o.norm() * r.norm())), rel=1e-12)
    assert cosine_similarity(-ref, ref) == pytest.approx(-1.0)


def test_sparse_output_error_against_dense():
    torch.manual_seed(3)
    q, k, v = (torch.randn(1, 2, 200, 32, dtype=torch.float64) for _ in range(3))
    full = sv.SparseMask.full(200, 200, 64, 64)
    err = sparse_output_error(q, k, v, full, backend="reference")
    assert err["relative_l1"] < 1e-12 and err["cosine"] == pytest.approx(1.0, abs=1e-12)
    keep = torch.rand(1, 2, 4, 4) < 0.5
    keep[..., 0] = True
    mask = sv.SparseMask.from_dense(keep, 200, 200, 64, 64)
    err = sparse_output_error(q, k, v, mask, backend="reference")
    probs = torch.softmax(q @ k.mT * 32 ** -0.5, -1)
    dense = probs @ v
    sparse_probs = probs * expand_block_mask(mask)
    sparse = (sparse_probs / sparse_probs.sum(-1, keepdim=True)) @ v
    assert err["relative_l1"] == pytest.approx(float((sparse - dense).abs().sum() / dense.abs().sum()), rel=1e-9)
    assert err["cosine"] == pytest.approx(float(torch.nn.functional.cosine_similarity(
        sparse.flatten(), dense.flatten(), dim=0)), rel=1e-9)
    assert err["relative_l1"] > 0.01
