"""Non-finite inputs: predict_mask keeps at least min_blocks tiles in every row (both backends, the same
masks), and block_sparse_attention then gives NaN where dense attention does, never silent zeros."""
from __future__ import annotations

import pytest
import torch

import sparsevid as sv
from oracles import DEVICE

PREDICT_BACKENDS = ["reference", "triton"]
ATTENTION_BACKENDS = ["reference", "gather", "triton"]
B, H, N, M, D, BLOCK = 1, 2, 256, 512, 32, 64
KB = M // BLOCK


def inputs(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, t, D, generator=gen).to(DEVICE) for t in (N, M, M)]


def dense(q, k, v):
    """Dense attention in float64 (NaN wherever a non-finite input reaches a row)."""
    return torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double()).float()


def predict(q, k, backend, rule, topk=2, **kwargs):
    return sv.predict_mask(q, k, rule=rule, topk=topk, topp=0.5, block_q=BLOCK, block_k=BLOCK, backend=backend,
                           **kwargs)[0]


@pytest.mark.parametrize("backend", PREDICT_BACKENDS)
def test_nan_in_q_keeps_the_rows_budget(backend):
    q, k, _ = inputs()
    q[0, 0, 70, 5] = float("nan")  # query block 1 of head 0
    topk_mask = predict(q, k, backend, "topk")
    assert topk_mask.keep.sum(dim=-1).eq(2).all()  # exactly the budget everywhere
    assert topk_mask.keep[0, 0, 1].tolist() == [True, True] + [False] * (KB - 2)  # unranked: lowest indices
    hybrid = predict(q, k, backend, "hybrid")
    assert hybrid.keep[0, 0, 1].all()  # its mass can reach no target: the whole row
    assert hybrid.keep.sum(dim=-1).ge(2).all()
    assert predict(q, k, backend, "topp", min_blocks=3).keep.sum(dim=-1).ge(3).all()


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("backend", PREDICT_BACKENDS)
@pytest.mark.parametrize("rule", ["topk", "topp", "hybrid"])
def test_non_finite_k_never_empties_a_row(backend, rule, value):
    q, k, _ = inputs(1)
    k[0, 1, 300, 7] = value
    mask = predict(q, k, backend, rule, min_blocks=2)
    assert mask.keep.sum(dim=-1).ge(2).all()
    assert mask.kv_count.ge(2).all()


@pytest.mark.parametrize("rule", ["topk", "hybrid"])
def test_backends_agree_on_non_finite_rows(rule):
    q, k, _ = inputs(2)
    q[0, 1, 3, 0] = float("nan")
    k[0, 0, 130, 1] = float("inf")
    masks = [predict(q, k, backend, rule) for backend in PREDICT_BACKENDS]
    assert torch.equal(masks[0].keep, masks[1].keep)


@pytest.mark.parametrize("backend", ATTENTION_BACKENDS)
def test_nan_in_q_makes_only_its_row_nan(backend):
    q, k, v = inputs(3)
    q[0, 0, 70, 5] = float("nan")
    mask = predict(q, k, "reference", "hybrid")
    out, lse = sv.block_sparse_attention(q, k, v, mask, return_lse=True, backend=backend)
    assert out[0, 0, 70].isnan().all() and lse[0, 0, 70].isnan()
    rest = torch.ones(B, H, N, dtype=torch.bool, device=DEVICE)
    rest[0, 0, 70] = False
    assert out[rest].isfinite().all() and lse[rest].isfinite().all()
    # The NaN row's query block keeps every key block: its other rows are dense attention itself.
    torch.testing.assert_close(out[0, 0, 64:128][rest[0, 0, 64:128]], dense(q, k, v)[0, 0, 64:128][rest[0, 0, 64:128]],
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("value", [float("inf"), float("nan")])
@pytest.mark.parametrize("backend", ATTENTION_BACKENDS)
def test_non_finite_k_gives_nan_where_dense_does(backend, value):
    """A NaN in k reaches every dense row; +inf the rows that score it +inf. Under hybrid the pooled rows that
    see it keep every key block, so the sparse output is NaN exactly where dense attention's is."""
    q, k, v = inputs(4)
    k[0, 0, 300, 7] = value
    mask = predict(q, k, "reference", "hybrid")
    out, lse = sv.block_sparse_attention(q, k, v, mask, return_lse=True, backend=backend)
    assert not (lse == float("-inf")).any()  # no row silently empty
    want_nan = dense(q, k, v).isnan().any(dim=-1)
    assert want_nan[0, 0].any() and not want_nan[0, 1].any()
    rows_seeing_it = mask.keep[0, 0, :, 300 // BLOCK].repeat_interleave(BLOCK)[:N]
    assert torch.equal(out.isnan().any(dim=-1)[0, 0][rows_seeing_it], want_nan[0, 0][rows_seeing_it])
    assert out[0, 1].isfinite().all()
