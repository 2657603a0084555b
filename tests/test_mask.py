"""SparseMask: index tables, sparsity by tile area, FlexAttention conversion, validation."""
from __future__ import annotations

import pytest
import torch

import sparsevid as sv
from sparsevid.ops.mask import expand_block_mask, kept_index_table


def test_index_tables_list_kept_blocks_in_order():
    keep = torch.rand(2, 3, 7, 11) < 0.4
    keep[0, 0, 2] = False
    mask = sv.SparseMask.from_dense(keep, 7 * 128 - 5, 11 * 64 - 1, 128, 64)
    for count, index, table in ((mask.kv_count, mask.kv_index, keep), (mask.q_count, mask.q_index, keep.transpose(-1, -2))):
        assert count.dtype == index.dtype == torch.int32
        for b in range(2):
            for h in range(3):
                for r in range(table.shape[-2]):
                    kept = torch.nonzero(table[b, h, r]).flatten().tolist()
                    c = int(count[b, h, r])
                    assert c == len(kept)
                    assert index[b, h, r, :c].tolist() == kept
                    # Padding repeats the last kept block (0 for empty rows): always a valid block index.
                    pad = index[b, h, r, c:].tolist()
                    assert pad == [kept[-1] if kept else 0] * len(pad)


def test_sparsity_weights_tiles_by_area():
    # N = 192: blocks of 128 and 64 rows; M = 100: blocks of 64 and 36 columns.
    keep = torch.tensor([[True, False], [False, True]]).view(1, 1, 2, 2)
    mask = sv.SparseMask.from_dense(keep, 192, 100, 128, 64)
    kept_pairs = 128 * 64 + 64 * 36
    assert mask.sparsity == pytest.approx(1 - kept_pairs / (192 * 100))
    assert expand_block_mask(mask).sum() == kept_pairs


def test_sparsity_per_head_and_full_mask():
    keep = torch.ones(1, 2, 2, 4, dtype=torch.bool)
    keep[0, 1, :, 1:] = False
    mask = sv.SparseMask.from_dense(keep, 256, 256, 128, 64)
    assert mask.sparsity_per_head.tolist() == [[0.0, 0.75]]
    assert sv.SparseMask.full(300, 200).sparsity == 0.0


def test_to_dense_round_trip_and_to_flex():
    keep = torch.rand(1, 2, 3, 5) < 0.5
    keep[..., 0] = True
    mask = sv.SparseMask.from_dense(keep, 300, 300, 128, 64)
    assert torch.equal(mask.to_dense(), keep)
    flex = mask.to_flex()
    assert flex.BLOCK_SIZE == (128, 64)
    assert torch.equal(flex.full_kv_num_blocks, mask.kv_count)
    assert torch.equal(flex.to_dense()[..., :3, :5].bool(), keep)


def test_kept_index_table_on_empty_and_full_rows():
    keep = torch.tensor([[False, False, False], [True, True, True], [False, True, False]])
    count, index = kept_index_table(keep)
    assert count.tolist() == [0, 3, 1]
    assert index.tolist() == [[0, 0, 0], [0, 1, 2], [1, 1, 1]]


def test_random_block_mask_keeps_diagonal_and_budget():
    mask = sv.random_block_mask(1, 4, 1024, 1024, 0.9, 128, 64, generator=torch.Generator().manual_seed(1))
    keep = mask.keep
    rows = torch.arange(8)
    assert keep[:, :, rows, rows * 2].all()
    assert (keep.sum(-1) == round(0.1 * 16)).all()


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(keep=torch.ones(1, 1, 2, 4, dtype=torch.uint8), q_len=256, kv_len=256), TypeError, "bool"),
    (dict(keep=torch.ones(1, 2, 4, dtype=torch.bool), q_len=256, kv_len=256), ValueError, "4 dims"),
    (dict(keep=torch.ones(1, 1, 2, 4, dtype=torch.bool), q_len=300, kv_len=256), ValueError, r"\(3, 4\)"),
    (dict(keep=torch.ones(1, 1, 2, 4, dtype=torch.bool), q_len=256, kv_len=256, block_k=32), ValueError, "block_k"),
    (dict(keep=torch.ones(1, 1, 2, 4, dtype=torch.bool), q_len=0, kv_len=256), ValueError, "q_len"),
    (dict(keep=[[True]], q_len=1, kv_len=1), TypeError, "torch.Tensor"),
    (dict(keep=torch.ones(0, 1, 2, 4, dtype=torch.bool), q_len=256, kv_len=256), ValueError, "non-empty"),
    (dict(keep=torch.ones(1, 1, 2, 4, dtype=torch.bool), q_len=256, kv_len=256, kv_table=torch.zeros(2)),
     TypeError, "kv_table"),
    (dict(keep=torch.ones(1, 1, 2, 4, dtype=torch.bool), q_len=256, kv_len=256,
          kv_table=(torch.zeros(1, 1, 2, dtype=torch.int32, device="meta"),
                    torch.zeros(1, 1, 2, 4, dtype=torch.int32, device="meta"))), ValueError, "kv_table must be on"),
])
def test_invalid_masks_raise(kwargs, error, message):
    with pytest.raises(error, match=message):
        sv.SparseMask.from_dense(**kwargs)


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(sparsity=1.0), ValueError, "sparsity"),
    (dict(sparsity="0.5"), TypeError, "sparsity"),
    (dict(sparsity=None), TypeError, "sparsity"),
    (dict(batch=0), ValueError, "batch"),
    (dict(heads=1.5), ValueError, "heads"),
    (dict(q_len=100.0), ValueError, "q_len"),
    (dict(block_q=0), ValueError, "block_q"),
    (dict(block_k=-64), ValueError, "block_k"),
    (dict(keep_diagonal="no"), TypeError, "keep_diagonal"),
])
def test_random_block_mask_rejects_bad_arguments(kwargs, error, message):
    arguments = dict(batch=1, heads=1, q_len=128, kv_len=128, sparsity=0.5) | kwargs
    with pytest.raises(error, match=message):
        sv.random_block_mask(**arguments)


def test_max_kept_blocks_is_read_once_per_mask(monkeypatch):
    keep = torch.zeros(2, 3, 4, 5, dtype=torch.bool)
    keep[1, 2, 3, :4] = True
    keep[0, 0, 0, 1] = True
    mask = sv.SparseMask.from_dense(keep, 4 * 64, 5 * 64, 64, 64)
    assert mask.max_kept_blocks == 4
    # Cached: a second request does not read the device again (the count table is not consulted).
    monkeypatch.setattr(type(mask), "kv_count", property(lambda self: pytest.fail("kv_count read again")))
    assert mask.max_kept_blocks == 4


@pytest.mark.parametrize("lengths", [(300, 200), (128, 64), (1, 333)], ids=["N300-M200", "one-block-each", "N1-M333"])
def test_full_mask_tables_are_the_ones_kept_index_table_builds(lengths):
    full = sv.SparseMask.full(*lengths, block_q=128, block_k=64)
    count, index = kept_index_table(full.keep)
    assert torch.equal(full.kv_count, count) and torch.equal(full.kv_index, index)
    assert full.kv_index.is_contiguous()
