"""Selection rules and options on hand-built pooled rows, on both predict_mask backends.

``inputs_for_rows`` builds q, k whose pooled scores are exactly the given probability rows (up to fp32
rounding): every token of key block j is the unit vector e_j and every token of query block i is log p_i,
so with scale 1 the pooled logits are log p_ij and their softmax is p_ij. Expected masks are computed
here by brute force in float64 (sort the row, walk the prefix), independently of the code under test.
"""
from __future__ import annotations

import pytest
import torch

import sparsevid as sv
from sparsevid.ops.selection import resolve_topk
from oracles import DEVICE

BACKENDS = ["reference", "triton"]


def inputs_for_rows(rows: torch.Tensor, block_q: int = 64, block_k: int = 64, dtype=torch.float32):
    """q [B, H, QB*block_q, D], k [B, H, KB*block_k, D] whose pooled score rows equal ``rows`` [B, H, QB, KB]."""
    b, h, qb, kb = rows.shape
    d = max(16, kb)
    logp = torch.zeros(b, h, qb, d, dtype=torch.float64)
    logp[..., :kb] = rows.double().log()
    q = logp.repeat_interleave(block_q, dim=2)
    k = torch.eye(kb, d, dtype=torch.float64).expand(b, h, kb, d).repeat_interleave(block_k, dim=2)
    return q.to(DEVICE, dtype), k.to(DEVICE, dtype)


def predict(rows, backend, **kwargs):
    kwargs.setdefault("block_q", 64)
    kwargs.setdefault("block_k", 64)
    q, k = inputs_for_rows(rows, kwargs["block_q"], kwargs["block_k"])
    return sv.predict_mask(q, k, scale=1.0, backend=backend, **kwargs)


def normalise(rows: torch.Tensor) -> torch.Tensor:
    return rows.double() / rows.double().sum(dim=-1, keepdim=True)


def expected_prefix(row: torch.Tensor, k: int | None, p: float | None, min_blocks: int = 1) -> set[int]:
    """Brute force: the indices of the longest of the top-k prefix and the shortest prefix reaching mass p
    (in the order of decreasing score, ties by lowest index)."""
    order = sorted(range(len(row)), key=lambda j: (-float(row[j]), j))
    length = max(k or 0, min_blocks)
    if p is not None:
        mass, n = 0.0, 0
        while n < len(row) and mass < p:
            mass += float(row[order[n]])
            n += 1
        length = max(length, n)
    return set(order[:min(length, len(row))])


def kept_set(mask: sv.SparseMask, b: int, h: int, i: int) -> set[int]:
    return set(torch.nonzero(mask.keep[b, h, i].cpu()).flatten().tolist())


def flat_row(kb: int) -> torch.Tensor:
    """Nearly uniform, distinct entries."""
    return normalise(1.0 + 0.01 * torch.arange(kb, 0, -1, dtype=torch.float64))


def sink_row(kb: int) -> torch.Tensor:
    """Block 0 holds 95% of the mass; the rest decays geometrically."""
    tail = 0.7 ** torch.arange(1, kb, dtype=torch.float64)
    return torch.cat([torch.tensor([0.95]), 0.05 * tail / tail.sum()])


@pytest.mark.parametrize("backend", BACKENDS)
def test_flat_row_topk_keeps_too_little_and_hybrid_enough(backend):
    kb = 16
    rows = flat_row(kb).expand(1, 1, 2, kb)
    mask_k, stats_k = predict(rows, backend, rule="topk", topk=2)
    mask_h, stats_h = predict(rows, backend, rule="hybrid", topk=2, topp=0.9)
    assert kept_set(mask_k, 0, 0, 0) == {0, 1}
    assert float(stats_k.kept_mass.max()) < 0.2
    assert kept_set(mask_h, 0, 0, 0) == expected_prefix(rows[0, 0, 0], 2, 0.9)
    assert len(kept_set(mask_h, 0, 0, 0)) >= 14
    assert float(stats_h.kept_mass.min()) >= 0.9


@pytest.mark.parametrize("backend", BACKENDS)
def test_sink_row_topp_keeps_only_the_sink_and_hybrid_adds_topk(backend):
    kb = 16
    rows = sink_row(kb).expand(1, 1, 1, kb)
    mask_p, stats_p = predict(rows, backend, rule="topp", topp=0.9)
    mask_h, _ = predict(rows, backend, rule="hybrid", topk=4, topp=0.9)
    assert kept_set(mask_p, 0, 0, 0) == {0}
    assert float(stats_p.kept_mass[0, 0, 0]) == pytest.approx(0.95, abs=1e-5)
    assert kept_set(mask_h, 0, 0, 0) == {0, 1, 2, 3}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rule", ["topk", "topp", "hybrid"])
def test_rules_keep_the_sorted_prefix_on_random_rows(backend, rule):
    torch.manual_seed(0)
    b, h, qb, kb = 2, 2, 3, 23
    rows = normalise(torch.rand(b, h, qb, kb, dtype=torch.float64) ** 3 + 1e-3)
    topk, topp = 0.2, 0.6
    mask, stats = predict(rows, backend, rule=rule, topk=topk, topp=topp)
    k = resolve_topk(topk, kb, h) if rule != "topp" else None
    p = topp if rule != "topk" else None
    for bi in range(b):
        for hi in range(h):
            for i in range(qb):
                want = expected_prefix(rows[bi, hi, i], k, p)
                assert kept_set(mask, bi, hi, i) == want, (bi, hi, i)
                kept_mass = sum(float(rows[bi, hi, i, j]) for j in want)
                assert float(stats.kept_mass[bi, hi, i]) == pytest.approx(kept_mass, abs=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_topk_keeps_exactly_k_with_ties_by_lowest_index(backend):
    rows = torch.stack([normalise(torch.tensor([1.0, 2.0, 2.0, 4.0, 2.0, 1.0, 2.0, 1.0])),
                        normalise(torch.ones(8))]).view(1, 1, 2, 8)
    mask, _ = predict(rows, backend, rule="topk", topk=2)
    assert kept_set(mask, 0, 0, 0) == {3, 1}  # 4.0, then the first of the four 2.0s
    assert kept_set(mask, 0, 0, 1) == {0, 1}


@pytest.mark.parametrize("backend", BACKENDS)
def test_flat_row_keeps_exactly_its_budget(backend):
    """All pooled scores equal (a zero query): top-k 25% of 16 key blocks keeps blocks 0..3, not all 16."""
    kb = 16
    q = torch.zeros(1, 2, 128, 32, device=DEVICE)
    k = torch.randn(1, 2, kb * 64, 32, device=DEVICE)
    mask, _ = sv.predict_mask(q, k, rule="topk", topk=0.25, block_q=64, block_k=64, backend=backend)
    assert mask.keep.sum(dim=-1).eq(4).all()
    assert mask.keep[..., :4].all()
    # Hybrid: the union of exactly 4 top-k blocks and the top-p set (ties at its threshold all kept).
    mask, _ = sv.predict_mask(q, k, rule="hybrid", topk=0.25, topp=0.1, block_q=64, block_k=64, backend=backend)
    assert mask.keep.all()


def expected_with_ties(row: torch.Tensor, k: int | None, p: float | None, min_blocks: int = 1) -> set[int]:
    """Brute force: exactly max(k, min_blocks) entries by decreasing score (ties by lowest index), united with
    the top-p set: every entry tied with or above the last one of the shortest prefix reaching mass p."""
    kept = expected_prefix(row, k, None, min_blocks)
    if p is not None:
        order = sorted(range(len(row)), key=lambda j: (-float(row[j]), j))
        tau = float(row[order[len(expected_prefix(row, None, p, 0)) - 1]])
        kept |= {j for j in range(len(row)) if float(row[j]) >= tau}
    return kept


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rule", ["topk", "topp", "hybrid"])
def test_long_rows(backend, rule):
    """Rows of 200 key blocks, longer than the 64 entries below which the Triton search packs its bracket:
    90 exact ties straddling the top-k threshold (more than fit the packing), a flat row, a sink row and a
    random row."""
    kb = 200
    gen = torch.Generator().manual_seed(2)
    tied = torch.cat([torch.full((10,), 8.0), torch.full((90,), 2.0), 0.1 + 0.9 * torch.rand(100, generator=gen)])
    tied = tied[torch.randperm(kb, generator=gen)]
    rows = torch.stack([normalise(tied), flat_row(kb), sink_row(kb),
                        normalise(torch.rand(kb, generator=gen, dtype=torch.float64) ** 3 + 1e-3)])
    topk, topp = 0.2, 0.8
    mask, stats = predict(rows.view(1, 1, 4, kb), backend, rule=rule, topk=topk, topp=topp)
    k = resolve_topk(topk, kb, 1) if rule != "topp" else None
    p = topp if rule != "topk" else None
    for i in range(4):
        want = expected_with_ties(rows[i], k, p)
        assert kept_set(mask, 0, 0, i) == want, i
        assert float(stats.kept_mass[0, 0, i]) == pytest.approx(sum(float(rows[i, j]) for j in want), abs=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_per_head_thresholds(backend):
    kb = 16
    row = normalise(torch.linspace(2.0, 1.0, kb, dtype=torch.float64))
    rows = row.expand(1, 3, 1, kb)
    counts = torch.tensor([1, 4, 9])
    mask, stats = predict(rows, backend, rule="topk", topk=counts)
    assert mask.kv_count[0, :, 0].cpu().tolist() == [1, 4, 9]
    fractions = torch.tensor([0.1, 0.5, 1.0])  # ceil(1.6) = 2, 8, 16 blocks
    mask, _ = predict(rows, backend, rule="topk", topk=fractions)
    assert mask.kv_count[0, :, 0].cpu().tolist() == [2, 8, 16]
    masses = torch.tensor([0.2, 0.5, 0.95])
    mask, _ = predict(rows, backend, rule="topp", topp=masses)
    for hi, p in enumerate(masses.tolist()):
        assert kept_set(mask, 0, hi, 0) == expected_prefix(row, None, p)
    assert stats.sparsity_per_head.shape == (3,)
    assert stats.sparsity_per_head[0] > stats.sparsity_per_head[1] > stats.sparsity_per_head[2]


@pytest.mark.parametrize("backend", BACKENDS)
def test_min_blocks_and_full_topp(backend):
    rows = sink_row(16).expand(1, 1, 1, 16)
    mask, _ = predict(rows, backend, rule="topp", topp=0.5, min_blocks=3)
    assert kept_set(mask, 0, 0, 0) == {0, 1, 2}
    mask, _ = predict(rows, backend, rule="topp", topp=1.0)
    assert kept_set(mask, 0, 0, 0) == set(range(16))


@pytest.mark.parametrize("backend", BACKENDS)
def test_sink_and_diagonal(backend):
    # Query blocks of 128 tokens against key blocks of 64: block i overlaps key blocks 2i and 2i+1.
    kb = 8
    row = normalise(torch.arange(kb, 0, -1, dtype=torch.float64) ** 4)  # block 0 largest
    rows = row.flip(-1).expand(1, 1, 4, kb)                              # block 7 largest
    mask, _ = predict(rows, backend, rule="topk", topk=1, block_q=128, block_k=64,
                      keep_sink=True, keep_diagonal=True)
    for i in range(4):
        assert kept_set(mask, 0, 0, i) == {7, 0, 2 * i, 2 * i + 1}


@pytest.mark.parametrize("backend", BACKENDS)
def test_diagonal_with_ragged_lengths(backend):
    torch.manual_seed(1)
    q = torch.randn(1, 1, 333, 16, device=DEVICE)
    k = torch.randn(1, 1, 200, 16, device=DEVICE)
    mask, _ = sv.predict_mask(q, k, rule="topk", topk=1, block_q=128, block_k=64, keep_diagonal=True,
                              backend=backend)
    # Query blocks cover 0-127, 128-255, 256-332; key blocks 0-63, 64-127, 128-191, 192-199.
    diagonal = [{0, 1}, {2, 3}, set()]
    for i, cols in enumerate(diagonal):
        assert cols <= kept_set(mask, 0, 0, i)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dissimilar_blocks_are_kept_in_full(backend):
    kb = 8
    rows = sink_row(kb).expand(1, 1, 3, kb)
    q, k = inputs_for_rows(rows)
    # Query block 1 and key block 5: tokens alternate in sign around a small mean, so their mean
    # misrepresents them (self-similarity near 0) while the other blocks are uniform (similarity 1).
    sign = torch.tensor([1.0, -1.0], device=DEVICE).repeat(32)[:, None]
    q[:, :, 64:128] = q[:, :, 64:128] * 0.01 + sign * q[:, :, 64:128].abs().max()
    k[:, :, 5 * 64:6 * 64] = k[:, :, 5 * 64:6 * 64] * 0.01 + sign
    mask, _ = sv.predict_mask(q, k, scale=1.0, rule="topp", topp=0.5, block_q=64, block_k=64,
                              similarity_threshold=0.5, backend=backend)
    assert kept_set(mask, 0, 0, 1) == set(range(kb))
    assert kept_set(mask, 0, 0, 0) == {0, 5}
    assert kept_set(mask, 0, 0, 2) == {0, 5}
    # Per-head thresholds: the head with threshold -1 keeps what the rule alone keeps.
    q2, k2 = q.expand(1, 2, -1, -1), k.expand(1, 2, -1, -1)
    kwargs = dict(scale=1.0, rule="topp", topp=0.5, block_q=64, block_k=64, backend=backend)
    mask, _ = sv.predict_mask(q2, k2, similarity_threshold=torch.tensor([0.5, -1.0]), **kwargs)
    plain, _ = sv.predict_mask(q2, k2, **kwargs)
    single, _ = sv.predict_mask(q, k, similarity_threshold=0.5, **kwargs)
    assert torch.equal(mask.keep[:, 0], single.keep[:, 0])
    assert torch.equal(mask.keep[:, 1], plain.keep[:, 1])
    assert not torch.equal(mask.keep[:, 0], plain.keep[:, 0])
