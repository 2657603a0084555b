"""Oracle recall against a brute-force float64 computation, its monotonicity, and predicted masks below it."""
import math

import pytest
import torch

import sparsevid as sv
from sparsevid.eval.metrics import attention_recall
from sparsevid.eval.oracle import (ExactTiles, OracleStudy, oracle_recall,
                                   tiles_for_sparsity)

SPARSITIES = (0.0, 0.5, 0.75, 0.9, 0.95)


def _qkv(b, h, n, m, d, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    # Keys and queries with a shared low-rank structure, so attention is peaked, as in a trained model.
    basis = torch.randn(4, d, generator=g, dtype=torch.float64)
    q = (torch.randn(b, h, n, 4, generator=g, dtype=torch.float64) @ basis) * 0.6
    k = (torch.randn(b, h, m, 4, generator=g, dtype=torch.float64) @ basis) * 0.6
    q, k = q + 0.3 * torch.randn(q.shape, generator=g, dtype=torch.float64), k + 0.3 * torch.randn(
        k.shape, generator=g, dtype=torch.float64)
    v = torch.randn(b, h, m, d, generator=g, dtype=torch.float64)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _brute_force(q, k, v, block_q, block_k, per_row):
    """Recall and relative L1 of the top-``per_row`` tiles per row, from the dense float64 softmax."""
    n, m = q.shape[2], k.shape[2]
    p = torch.softmax(q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5, dim=-1)
    qb, kb = math.ceil(n / block_q), math.ceil(m / block_k)
    key_block = torch.arange(m) // block_k
    row_block = torch.arange(n) // block_q
    per_key_block = torch.zeros(*p.shape[:3], kb, dtype=torch.float64).index_add_(-1, key_block, p)  # [B, H, N, KB]
    tile = torch.zeros(*p.shape[:2], qb, kb, dtype=torch.float64).index_add_(2, row_block, per_key_block)
    tile = tile / torch.bincount(row_block).double().view(-1, 1)
    keep = torch.zeros_like(tile, dtype=torch.bool).scatter_(-1, tile.topk(per_row, dim=-1).indices, True)
    keep_rows = keep[:, :, row_block][..., key_block]  # [B, H, N, M]
    recall = float((per_key_block * keep[:, :, row_block]).sum(-1).mean())
    masked = torch.where(keep_rows, p, 0.0)
    out = (masked / masked.sum(-1, keepdim=True)) @ v
    dense = p @ v
    return recall, float((out - dense).abs().sum() / dense.abs().sum()), keep


@pytest.mark.parametrize("b,h,n,m,block_q,block_k", [(1, 2, 200, 333, 64, 64), (2, 1, 256, 256, 128, 64)],
                         ids=["uneven-200x333", "batch2-256"])
def test_oracle_matches_brute_force(b, h, n, m, block_q, block_k):
    q, k, v = _qkv(b, h, n, m, 32)
    result = oracle_recall(q, k, v, SPARSITIES, block_q, block_k, backend="reference")
    kb = math.ceil(m / block_k)
    for x, recall, error in zip(SPARSITIES, result["recall"], result["output_rel_l1"]):
        expected_recall, expected_error, keep = _brute_force(q, k, v, block_q, block_k, tiles_for_sparsity(x, kb))
        assert recall == pytest.approx(expected_recall, abs=1e-6)
        assert error == pytest.approx(expected_error, rel=1e-5, abs=1e-9)
        mask = sv.SparseMask.from_dense(keep, n, m, block_q, block_k)
        assert float(attention_recall(q, k, mask).mean()) == pytest.approx(recall, abs=1e-6)
    # Every tile kept at 0% sparsity: all the mass, the dense output.
    assert result["recall"][0] == pytest.approx(1.0, abs=1e-6) and result["output_rel_l1"][0] < 1e-6
    assert result["achieved_sparsity"][0] == 0.0
    # More sparsity keeps less mass (non-increasing) and a larger output error.
    assert all(a >= c - 1e-9 for a, c in zip(result["recall"], result["recall"][1:]))
    assert result["recall"][-1] < result["recall"][1] < 1.0
    assert result["output_rel_l1"][-1] > result["output_rel_l1"][1] > 0


def test_predicted_recall_never_beats_the_oracle_per_row():
    q, k, v = _qkv(2, 2, 512, 512, 64, dtype=torch.float32, seed=3)
    masks = {f"{rule}": sv.predict_mask(q, k, rule=rule, topk=0.25, topp=0.6, block_q=64, block_k=64)[0]
             for rule in ("topk", "topp", "hybrid")}
    result = oracle_recall(q, k, v, SPARSITIES, 64, 64, backend="reference", masks=masks)
    tiles = ExactTiles.measure(q, k, v, 64, 64, backend="reference")
    for name, mask in masks.items():
        entry = result["predicted"][name]
        assert entry["sparsity"] == pytest.approx(mask.sparsity) and 0 < entry["sparsity"] < 1
        assert entry["recall"] == pytest.approx(float(attention_recall(q, k, mask).mean()), abs=1e-5)
        kept = (tiles.mass * mask.keep).sum(-1)
        ceiling = (tiles.mass * tiles.top_tiles(mask.keep.sum(-1))).sum(-1)
        assert bool((kept <= ceiling + 1e-6).all()), name
        assert entry["recall"] <= entry["oracle_recall"] + 1e-9
    # The top-k mask keeps the same count in every row as the oracle; rows with a real choice lose mass.
    assert result["predicted"]["topk"]["recall"] < result["predicted"]["topk"]["oracle_recall"]


def test_oracle_input_checks():
    q, k, v = _qkv(1, 1, 128, 128, 16, dtype=torch.float32)
    with pytest.raises(ValueError, match="sparsities"):
        oracle_recall(q, k, v, [1.0])
    tiles = ExactTiles.measure(q, k, v, 64, 64, backend="reference")
    other = sv.SparseMask.full(128, 128, 128, 64)
    from sparsevid.eval.oracle import predicted_recall
    with pytest.raises(ValueError, match="tiles"):
        predicted_recall(tiles, other)


def test_oracle_study_from_recorded_calls():
    study = OracleStudy(sparsities=(0.5, 0.9), block_q=64, block_k=64, backend="reference")
    for layer in range(2):
        for step in (0, 4):
            q, k, v = _qkv(1, 2, 256, 256, 32, dtype=torch.float32, seed=layer * 10 + step)
            study.add(layer, step, q, k, v)
    summary = study.summary()
    assert summary["layers"] == [0, 1] and summary["steps"] == [0, 4]
    assert len(summary["oracle"]["recall_per_layer"]) == 2 and len(summary["oracle"]["recall_per_layer"][0]) == 2


@pytest.mark.gpu
def test_oracle_at_wan_length_does_not_materialise_scores():
    """32,768 tokens, 2 heads: an N x N fp32 score matrix per head alone would take 4 GiB."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    q, k, v = (torch.randn(1, 2, 32768, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    result = oracle_recall(q, k, v, (0.0, 0.9, 0.97))
    assert torch.cuda.max_memory_allocated() - base < 1 << 30
    assert result["recall"][0] == pytest.approx(1.0, abs=1e-3)
    assert result["recall"][0] >= result["recall"][1] >= result["recall"][2] > 0
