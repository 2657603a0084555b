"""Reduced search: ``predict_mask(..., within=earlier_mask)`` on both backends, and ``select_from_mass`` on
exact tile masses."""
from __future__ import annotations

import math

import pytest
import torch

import sparsevid as sv
from sparsevid.ops import select_from_mass
from sparsevid.ops.pooling import pool_blocks, pooled_scores
from oracles import DEVICE

BACKENDS = ["reference", "triton"]


def peaked_qk(b, h, n, d, blocks=64):
    """q, k whose pooled scores are peaked: each block shares a random direction, plus noise."""
    nb = -(-n // blocks)
    centres = torch.randn(b, h, nb, d).repeat_interleave(blocks, dim=2)[:, :, :n]
    q = (2 * centres + 0.5 * torch.randn(b, h, n, d)).to(DEVICE)
    k = (2 * centres + 0.5 * torch.randn(b, h, n, d)).to(DEVICE)
    return q, k


@pytest.fixture
def earlier():
    q, k = peaked_qk(2, 2, 700, 32)
    mask, _ = sv.predict_mask(q, k, rule="topk", topk=0.5, block_q=64, block_k=64, backend="reference")
    assert 0.4 < mask.sparsity < 0.6
    return q, k, mask


@pytest.mark.parametrize("rule,kw", [("topk", dict(topk=0.2)), ("topp", dict(topp=0.8)),
                                     ("hybrid", dict(topk=0.1, topp=0.7)), ("topk", dict(topk=0.9))],
                         ids=["topk", "topp", "hybrid", "topk-above-candidates"])
@pytest.mark.parametrize("opts", [{}, dict(keep_sink=True, keep_diagonal=True), dict(similarity_threshold=0.9)],
                         ids=["plain", "sink-diag", "similarity"])
def test_within_keeps_a_subset_chosen_among_candidates(earlier, rule, kw, opts):
    """The PyTorch path (the Triton path is checked against it below)."""
    q, k, prev = earlier
    mask, stats = sv.predict_mask(q, k, rule=rule, block_q=64, block_k=64, backend="reference", within=prev,
                                  **kw, **opts)
    assert not (mask.keep & ~prev.keep).any()
    # Same rule on full-row pooled scores with non-candidates zeroed (sort-based, independent of the kernels).
    scores = pooled_scores(pool_blocks(q, 64), pool_blocks(k, 64), q.shape[-1] ** -0.5) * prev.keep
    if not opts:
        order = scores.sort(dim=-1, descending=True)
        kept_sorted = torch.gather(mask.keep, -1, order.indices)
        count = mask.keep.sum(-1)
        # Kept tiles are the best-scoring candidates: a prefix of the sorted row.
        assert torch.equal(kept_sorted, torch.arange(scores.shape[-1], device=DEVICE) < count.unsqueeze(-1))
        candidates = prev.keep.sum(-1).expand_as(count)
        if "topk" in kw:
            k_count = math.ceil(kw["topk"] * scores.shape[-1])
            assert (count >= torch.clamp(candidates, max=k_count)).all()
        if "topp" in kw:
            mass = (scores * mask.keep).sum(-1)
            assert ((mass >= kw["topp"] - 1e-6) | (count == candidates)).all()
    assert torch.allclose(stats.kept_mass, (pooled_scores(pool_blocks(q, 64), pool_blocks(k, 64),
                                                          q.shape[-1] ** -0.5) * mask.keep).sum(-1), atol=1e-5)


def test_within_backends_agree(earlier):
    q, k, prev = earlier
    for kw in (dict(rule="topk", topk=0.25), dict(rule="hybrid", topk=0.1, topp=0.75, keep_diagonal=True),
               dict(rule="topp", topp=0.6, keep_sink=True, similarity_threshold=0.9)):
        a, _ = sv.predict_mask(q, k, block_q=64, block_k=64, backend="reference", within=prev, **kw)
        t, _ = sv.predict_mask(q, k, block_q=64, block_k=64, backend="triton", within=prev, **kw)
        assert torch.equal(a.keep, t.keep)
        assert torch.equal(t.kv_count, a.kv_count) and torch.equal(t.kv_index, a.kv_index)


def test_within_with_empty_rows_and_broadcast_mask():
    q, k = peaked_qk(2, 2, 333, 32)
    keep = torch.rand(1, 2, 6, 6) < 0.5
    keep[..., 3, :] = False
    prev = sv.SparseMask.from_dense(keep.to(DEVICE), 333, 333, 64, 64)
    for backend in BACKENDS:
        mask, _ = sv.predict_mask(q, k, rule="topk", topk=2, block_q=64, block_k=64, keep_sink=True,
                                  backend=backend, within=prev)
        assert mask.keep.shape == (2, 2, 6, 6)
        assert not mask.keep[..., 3, :].any()
        assert not (mask.keep & ~prev.keep).any()


def test_within_is_checked():
    q, k = peaked_qk(1, 2, 256, 32)
    prev = sv.SparseMask.full(256, 256, 64, 64, device=DEVICE)
    with pytest.raises(TypeError, match="within"):
        sv.predict_mask(q, k, within=prev.keep)
    with pytest.raises(ValueError, match="within has blocks"):
        sv.predict_mask(q, k, block_q=128, block_k=64, within=prev)
    with pytest.raises(ValueError, match="q_len"):
        sv.predict_mask(q[:, :, :200], k, block_q=64, block_k=64, within=prev)


# ----------------------------------------------------------------------------- select_from_mass

def masses(b=2, h=2, n=333, d=32):
    q, k = peaked_qk(b, h, n, d)
    v = torch.randn_like(k)
    keep = torch.rand(b, h, 6, 6) < 0.6
    keep[..., 1, :] = False
    keep[..., 0, 0] = True
    mask = sv.SparseMask.from_dense(keep.to(DEVICE), n, n, 64, 64)
    _, mass = sv.block_sparse_attention(q, k, v, mask, return_tile_mass=True, backend="reference")
    return mask, mass


@pytest.mark.parametrize("rule,kw", [("topp", dict(topp=0.6)), ("topk", dict(topk=2)),
                                     ("hybrid", dict(topk=1, topp=0.8))])
def test_select_from_mass_applies_the_rule_to_exact_masses(rule, kw):
    mask, mass = masses()
    new, stats = select_from_mass(mass, mask, rule=rule, **kw)
    assert not (new.keep & ~mask.keep).any()
    count = new.keep.sum(-1)
    candidates = mask.keep.sum(-1).expand_as(count)
    kept = (mass * new.keep).sum(-1)
    assert torch.allclose(stats.kept_mass, kept)
    # The kept tiles are the heaviest candidates, and dropping the lightest one breaks the rule.
    lightest_kept = torch.where(new.keep, mass, torch.inf).amin(-1)
    heaviest_dropped = torch.where(mask.keep & ~new.keep, mass, -torch.inf).amax(-1)
    assert (lightest_kept >= heaviest_dropped).all()
    need_k = min(kw.get("topk", 0), 6)
    enough_k = count >= torch.clamp(candidates, max=need_k)
    enough_p = (kept >= kw.get("topp", 0) - 1e-6) | (count == candidates)
    assert (enough_k & enough_p).all()
    without_lightest = kept - torch.where(count > 0, lightest_kept, 0)
    minimal = (count - 1 < torch.clamp(candidates, max=max(need_k, 1))) | (without_lightest < kw.get("topp", 0))
    assert minimal[count > 0].all()


def test_select_from_mass_row_share_keeps_topp_a_share_of_the_full_row():
    mask, mass = masses()
    half = torch.full(mass.shape[:-1], 0.5, device=DEVICE)
    new, stats = select_from_mass(mass, mask, rule="topp", topp=0.6, row_share=half)
    # The mask holds only half of each full row, so 0.6 of the full row is out of reach: keep all candidates.
    assert torch.equal(new.keep, mask.keep.expand_as(new.keep))
    assert torch.allclose(stats.kept_mass, 0.5 * mass.sum(-1))
    new, _ = select_from_mass(mass, mask, rule="topp", topp=0.3, row_share=half)
    assert torch.equal(new.keep, select_from_mass(mass, mask, rule="topp", topp=0.6)[0].keep)


def test_select_from_mass_options_stay_inside_the_mask():
    mask, mass = masses()
    new, _ = select_from_mass(mass, mask, rule="topk", topk=1, keep_sink=True, keep_diagonal=True)
    assert not (new.keep & ~mask.keep).any()
    assert new.keep[..., 0, 0].all()


def test_select_from_mass_is_checked():
    mask, mass = masses()
    with pytest.raises(ValueError, match="tile_mass must have shape"):
        select_from_mass(mass[..., :3], mask)
    with pytest.raises(TypeError, match="tile_mass"):
        select_from_mass(mass > 0, mask)
    with pytest.raises(TypeError, match="mask must be"):
        select_from_mass(mass, mask.keep)
    with pytest.raises(ValueError, match="rule"):
        select_from_mass(mass, mask, rule="top")
    with pytest.raises(ValueError, match="topp"):
        select_from_mass(mass, mask, topp=1.5)
    with pytest.raises(ValueError, match="row_share must broadcast"):
        select_from_mass(mass, mask, row_share=torch.ones(3, device=DEVICE))
