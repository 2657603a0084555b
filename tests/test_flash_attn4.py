"""backend="flash_attn4": the mask's tables as flash-attn-4 reads them, the clear errors (CPU), and on a Hopper GPU
with flash-attn-4 installed the forward against float64 attention on the same mask.

Error budget (DESIGN.md section 3): as the Triton kernel's, the output's relative error vs float64 is at most 2x
that of plain PyTorch attention computed in bf16 on the same inputs; the lse within 1e-3.
"""
from __future__ import annotations

import pytest
import torch

import sparsevid as sv
from oracles import GPU_ATTENTION_CASES, dense_masked_attention, rel_err
from sparsevid.ops.flash_attn4 import flash_attn4_tables


def test_the_tables_are_the_masks_kept_tiles_as_full_blocks_and_no_partial_ones():
    keep = torch.rand(2, 3, 4, 6, generator=torch.Generator().manual_seed(0)) < 0.5
    mask = sv.SparseMask.from_dense(keep, 512, 384, 128, 64)
    tables = flash_attn4_tables(mask.kv_count.to(torch.int32), mask.kv_index.to(torch.int32))
    assert all(t.dtype == torch.int32 for t in tables.values())
    assert torch.equal(tables["full_block_cnt"], keep.sum(-1).to(torch.int32))
    for b, h, row in ((0, 0, 0), (1, 2, 3)):
        kept = tables["full_block_idx"][b, h, row, :tables["full_block_cnt"][b, h, row]]
        assert torch.equal(kept.long(), keep[b, h, row].nonzero().flatten())
    assert tables["mask_block_cnt"].shape == (2, 3, 4) and not tables["mask_block_cnt"].any()
    assert tables["mask_block_idx"].shape == (2, 3, 4, 1)


def _cpu_inputs(dtype=torch.bfloat16, d=64, requires_grad=False):
    q, k, v = (torch.randn(1, 2, 256, d, dtype=dtype, requires_grad=requires_grad) for _ in range(3))
    return q, k, v, sv.random_block_mask(1, 2, 256, 256, 0.5, 128, 64)


@pytest.mark.parametrize("change, error, match", [
    ({}, ValueError, "needs CUDA tensors"),
    ({"requires_grad": True}, ValueError, "forward for inference"),
    ({"dtype": torch.float32}, TypeError, "supports dtypes"),
    ({"d": 72 + 4}, ValueError, "multiples of 8"),
])
def test_what_it_cannot_run_is_refused_with_a_clear_error(change, error, match):
    q, k, v, mask = _cpu_inputs(**change)
    with pytest.raises(error, match=match):
        sv.block_sparse_attention(q, k, v, mask, backend="flash_attn4")


def test_a_config_takes_it_and_predicts_its_masks_with_the_default_predictor():
    config = sv.SparseConfig(backend="flash_attn4")
    assert config.backend == "flash_attn4"
    assert config.plan(0, step=0).predict_backend == "auto"
    with pytest.raises(ValueError, match="runs on the backends"):
        sv.SparseConfig(backend="flash_attn4", precision="int8")


def _hopper_with_flash_attn4() -> None:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs a Hopper GPU")
    pytest.importorskip("flash_attn.cute", reason="needs flash-attn-4")


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_ATTENTION_CASES)
def test_forward_within_budget_of_plain_pytorch(case):
    _hopper_with_flash_attn4()
    b, h, n, m, d, block_q, block_k, sparsity = case
    mask = sv.random_block_mask(b, h, n, m, sparsity, block_q, block_k, device="cuda")
    q, k, v = (torch.randn(b, h, t, d, device="cuda", dtype=torch.bfloat16) for t in (n, m, m))
    out, lse = sv.block_sparse_attention(q, k, v, mask, return_lse=True, backend="flash_attn4")
    ref_out, ref_lse = sv.block_sparse_attention(q.double(), k.double(), v.double(), mask, return_lse=True,
                                                 backend="reference")
    low_out, _ = dense_masked_attention(q, k, v, mask, compute_dtype=torch.bfloat16)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.dtype == torch.float32
    assert rel_err(out, ref_out) <= 2 * rel_err(low_out, ref_out)
    assert rel_err(lse, ref_lse) < 1e-3


@pytest.mark.gpu
def test_rows_without_kept_tiles_give_zeros_and_lse_minus_infinity():
    _hopper_with_flash_attn4()
    keep = torch.rand(1, 2, 8, 16, generator=torch.Generator().manual_seed(1)) < 0.3
    keep[0, 0, 3] = False
    keep[0, 1, :2] = False
    mask = sv.SparseMask.from_dense(keep.cuda(), 1000, 1000, 128, 64)
    q, k, v = (torch.randn(1, 2, 1000, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out, lse = sv.block_sparse_attention(q, k, v, mask, return_lse=True, backend="flash_attn4")
    ref_out, ref_lse = sv.block_sparse_attention(q, k, v, mask, return_lse=True, backend="triton")
    assert not out[0, 0, 384:512].any() and not out[0, 1, :256].any()
    assert torch.isneginf(lse[0, 0, 384:512]).all() and torch.isneginf(lse[0, 1, :256]).all()
    assert rel_err(out, ref_out) < 1e-2


@pytest.mark.gpu
def test_compiled_call_matches_eager():
    _hopper_with_flash_attn4()
    mask = sv.random_block_mask(1, 2, 4096, 4096, 0.8, 128, 64, device="cuda")
    q, k, v = (torch.randn(1, 2, 4096, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    attend = lambda q, k, v: sv.block_sparse_attention(q, k, v, mask, backend="flash_attn4")  # noqa: E731
    compiled = torch.compile(attend, fullgraph=True)
    assert torch.equal(compiled(q, k, v), attend(q, k, v))
