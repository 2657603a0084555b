"""The peers benchmark's CPU parts: sparsevid's mask as block rows (the BSR layout FlashInfer takes) and the table
of what ran and why the rest did not."""
import torch

import sparsevid as sv
from benchmarks.bench_attention_peers import bsr_rows, markdown


def test_block_rows_list_exactly_the_kept_key_blocks_of_every_head_and_query_block():
    generator = torch.Generator().manual_seed(0)
    keep = torch.rand(2, 3, 5, 7, generator=generator) < 0.4
    keep[..., 2] = True
    mask = sv.SparseMask.from_dense(keep, 5 * 64, 7 * 64 - 10, 64, 64)
    indptr, indices = bsr_rows(mask)
    assert indptr.shape == (2, 3, 6) and indptr.dtype == indices.dtype == torch.int32
    assert int(indptr[0, 0, 0]) == 0 and int(indptr[-1, -1, -1]) == indices.numel() == int(keep.sum())
    for b, h, r in torch.cartesian_prod(torch.arange(2), torch.arange(3), torch.arange(5)).tolist():
        row = indices[indptr[b, h, r]:indptr[b, h, r + 1]]
        assert sorted(row.tolist()) == keep[b, h, r].nonzero().flatten().tolist()


def test_the_table_gives_times_for_peers_that_ran_and_the_reason_for_the_others():
    common = {"shape": "wan1.3b-480p", "sparsity": 0.95}
    table = markdown([{**common, "peer": "sparsevid bf16", "ran": True, "ms": 0.69, "x_cudnn": 16.8},
                      {**common, "peer": "sageattention (dense)", "ran": True, "ms": 9.0, "x_cudnn": 1.3,
                       "ms_at_kept_share": 0.45, "cosine": 0.9991, "rel_l1": 0.031},
                      {**common, "peer": "flashinfer block-sparse", "ran": False,
                       "why": "ModuleNotFoundError: No module named 'flashinfer'"}])
    lines = table.splitlines()
    assert "| 0.690 | 16.8x | - | - | |" in lines[2]
    assert "| 9.000 | 1.3x | 0.450 | 0.99910 / 0.0310 | |" in lines[3]
    assert lines[4].endswith("| - | - | - | - | ModuleNotFoundError: No module named 'flashinfer' |")
