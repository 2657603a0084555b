"""benchmarks/hybrid_split.py: masks calibrated to one sparsity as the budget moves from top-k to top-p."""
import pytest
import torch

from sparsevid_lab.studies.hybrid_split import rule_for_share, split_study


def _calls():
    gen = torch.Generator().manual_seed(0)
    # two calls of 1 x 2 heads x 1024 tokens x 32: 8 query blocks of 128, 16 key blocks of 64
    return [(torch.randn(1, 2, 1024, 32, generator=gen), torch.randn(1, 2, 1024, 32, generator=gen)) for _ in range(2)]


def test_the_shares_run_from_top_p_alone_to_top_k_alone():
    calls = _calls()
    assert rule_for_share(1.0, 0.75, calls) == {"rule": "topk", "topk": 0.25}
    assert rule_for_share(0.0, 0.75, calls)["rule"] == "topp"
    hybrid = rule_for_share(0.5, 0.75, calls)
    assert hybrid["rule"] == "hybrid" and hybrid["topk"] == 0.125 and 0 < hybrid["topp"] <= 1


def test_every_share_reaches_the_target_and_keeps_no_more_than_its_ceiling():
    rows = split_study(_calls(), 0.75, shares=(0.0, 0.5, 1.0))
    assert [r["share"] for r in rows] == [0.0, 0.5, 1.0]
    assert rows[-1]["sparsity"] == pytest.approx(0.75)  # top-k: 4 of 16 key blocks in every row
    for r in rows:
        assert abs(r["sparsity"] - 0.75) < 0.05, r  # bisection on p over 16 key blocks a row
        assert 0 < r["recall"] <= r["oracle_recall"] + 1e-9 <= 1 + 1e-9
