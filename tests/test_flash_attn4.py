"""backend="flash_attn4": the mask's tables as flash-attn-4 reads them, the clear errors (CPU), and on a Hopper GPU
with flash-attn-4 installed the forward and backward against float64 attention on the same mask.

Error budget (DESIGN.md section 3): as the Triton kernels', the output's relative error vs float64 is at most 2x
that of plain PyTorch attention computed in bf16 on the same inputs, each gradient's at most 3x; the lse within 1e-3.
"""
from __future__ import annotations

import sys

import pytest
import torch

import sparsevid as sv
from oracles import GPU_ATTENTION_CASES, dense_masked_attention, rel_err
from sparsevid.ops import attention
from sparsevid.ops.flash_attn4 import (_device_problem, check_flash_attn4_request, flash_attn4_problem, flash_attn4_runs,
                                      flash_attn4_tables)


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


def test_the_backward_tables_are_the_transposed_mask():
    keep = torch.rand(1, 2, 4, 3, generator=torch.Generator().manual_seed(2)) < 0.5
    mask = sv.SparseMask.from_dense(keep, 512, 384, 128, 128)
    tables = flash_attn4_tables(mask.q_count, mask.q_index)
    assert torch.equal(tables["full_block_cnt"], keep.sum(-2).to(torch.int32))
    kept = tables["full_block_idx"][0, 1, 2, :tables["full_block_cnt"][0, 1, 2]]
    assert torch.equal(kept.long(), keep[0, 1, :, 2].nonzero().flatten())
    assert tables["mask_block_cnt"].shape == (1, 2, 3) and not tables["mask_block_cnt"].any()


def _cpu_inputs(dtype=torch.bfloat16, d=64, requires_grad=False):
    q, k, v = (torch.randn(1, 2, 256, d, dtype=dtype, requires_grad=requires_grad) for _ in range(3))
    return q, k, v, sv.random_block_mask(1, 2, 256, 256, 0.5, 128, 64)


@pytest.mark.parametrize("change, error, match", [
    ({}, ValueError, "needs CUDA tensors"),
    ({"requires_grad": True}, ValueError, "needs CUDA tensors"),
    ({"dtype": torch.float32}, TypeError, "supports dtypes"),
    ({"d": 72 + 4}, ValueError, "multiples of 8"),
])
def test_what_it_cannot_run_is_refused_with_a_clear_error(change, error, match):
    q, k, v, mask = _cpu_inputs(**change)
    with pytest.raises(error, match=match):
        sv.block_sparse_attention(q, k, v, mask, backend="flash_attn4")


def test_auto_takes_it_only_where_it_runs_the_call():
    q, k, v, mask = _cpu_inputs()
    assert flash_attn4_problem(q, k, v, mask)[0] is ValueError and not flash_attn4_runs(q, k, v, mask)
    assert flash_attn4_problem(q.float(), k.float(), v.float(), mask)[0] is TypeError
    assert attention.call_backend(q, k, v, mask) == "gather"
    assert attention.call_backend(q, k, v, mask, "triton") == "triton"


def test_auto_asks_whether_it_runs_without_breaking_a_compiled_graph():
    q, k, v, mask = _cpu_inputs()
    runs = torch.compile(lambda q, k, v: flash_attn4_runs(q, k, v, mask), backend="eager", fullgraph=True)
    assert runs(q, k, v) is False


@pytest.fixture
def runnable(monkeypatch):
    """flash_attn4_problem answering that flash-attn-4 can run any call (the deterministic rule alone checked)."""
    monkeypatch.setattr("sparsevid.ops.flash_attn4.flash_attn4_problem", lambda q, k, v, mask: None)


@pytest.mark.parametrize("mode", ["off", "strict", "warn_only"])
def test_its_gradients_are_refused_under_deterministic_algorithms(runnable, mode):
    q, k, v, mask = _cpu_inputs(requires_grad=True)
    try:
        torch.use_deterministic_algorithms(mode != "off", warn_only=mode == "warn_only")
        if mode == "strict":
            with pytest.raises(RuntimeError, match="use_deterministic_algorithms"):
                check_flash_attn4_request(q, k, v, mask)
        elif mode == "warn_only":
            with pytest.warns(UserWarning, match="not deterministic"):
                check_flash_attn4_request(q, k, v, mask)
        else:
            check_flash_attn4_request(q, k, v, mask)
        with torch.no_grad():  # no gradients: nothing to refuse
            check_flash_attn4_request(q, k, v, mask)
        assert flash_attn4_runs(q, k, v, mask) == (mode == "off")
    finally:
        torch.use_deterministic_algorithms(False)


def test_the_explicit_backends_check_traces_in_one_graph(runnable):
    q, k, v, mask = _cpu_inputs(requires_grad=True)

    def check(q, k, v):
        check_flash_attn4_request(q, k, v, mask)
        return q + 1

    assert torch.equal(torch.compile(check, backend="eager", fullgraph=True)(q, k, v), q + 1)


class _BrokenInstall:
    """A meta-path finder for which importing flash_attn fails as a broken install does (not an ImportError)."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "flash_attn":
            raise RuntimeError("CUDA bindings mismatch")
        return None


@pytest.mark.parametrize("broken", [False, True], ids=["missing", "broken"])
def test_a_hopper_gpu_without_a_working_flash_attn4_is_told_to_install_it(monkeypatch, broken):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (9, 0))
    for name in [n for n in sys.modules if n.split(".")[0] == "flash_attn"]:
        monkeypatch.delitem(sys.modules, name)
    if broken:
        monkeypatch.setattr(sys, "meta_path", [_BrokenInstall(), *sys.meta_path])
    else:
        monkeypatch.setitem(sys.modules, "flash_attn", None)
    _device_problem.cache_clear()
    try:
        problem, missing_package = _device_problem(0)
    finally:
        _device_problem.cache_clear()
    assert missing_package and "pip install flash-attn-4" in problem
    assert ("RuntimeError: CUDA bindings mismatch" in problem) == broken


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


def _case_inputs(case, requires_grad=False):
    """A GPU case's random mask and bf16 q, k, v on CUDA (after skipping unless flash-attn-4 can run)."""
    _hopper_with_flash_attn4()
    b, h, n, m, d, block_q, block_k, sparsity = case
    mask = sv.random_block_mask(b, h, n, m, sparsity, block_q, block_k, device="cuda")
    return mask, *(torch.randn(b, h, t, d, device="cuda", dtype=torch.bfloat16, requires_grad=requires_grad)
                   for t in (n, m, m))


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_ATTENTION_CASES)
def test_forward_within_budget_of_plain_pytorch(case):
    mask, q, k, v = _case_inputs(case)
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


# 128x128 blocks, which its Hopper backward tiles at head dim <= 128; the Wan length, N != M with B = 2, one block
TRAINABLE_CASES = [GPU_ATTENTION_CASES[1], GPU_ATTENTION_CASES[4],
                   pytest.param((2, 3, 4133, 2900, 128, 128, 128, 0.5), id="B2-N4133-M2900-d128-128x128"),
                   pytest.param((1, 2, 1000, 1000, 64, 128, 128, 0.5), id="N1000-d64-128x128")]


@pytest.mark.gpu
@pytest.mark.parametrize("case", TRAINABLE_CASES)
def test_gradients_within_budget_of_plain_pytorch(case):
    mask, q, k, v = _case_inputs(case, requires_grad=True)
    grad_out = torch.randn_like(q)
    grads = torch.autograd.grad(sv.block_sparse_attention(q, k, v, mask, backend="flash_attn4"), (q, k, v), grad_out)
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_grads = torch.autograd.grad(sv.block_sparse_attention(*ref_in, mask, backend="reference"), ref_in,
                                    grad_out.double())
    low_in = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    low_grads = torch.autograd.grad(dense_masked_attention(*low_in, mask, compute_dtype=torch.bfloat16)[0], low_in,
                                    grad_out)
    for g, x, low, ref in zip(grads, (q, k, v), low_grads, ref_grads):
        assert g.shape == x.shape and g.dtype == x.dtype
        assert rel_err(g, ref) <= 3 * rel_err(low, ref)


@pytest.mark.gpu
def test_gradient_through_lse_within_budget():
    """Context parallelism merges partial outputs by their lse, so its gradient must flow."""
    _hopper_with_flash_attn4()
    mask = sv.random_block_mask(1, 2, 2048, 2048, 0.7, 128, 128, device="cuda")
    inputs = [torch.randn(1, 2, 2048, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    weight = torch.randn(1, 2, 2048, device="cuda", dtype=torch.float64)

    def grads(attend, dtype):
        q, k, v = (t.to(dtype).requires_grad_() for t in inputs)
        out, lse = attend(q, k, v)
        return torch.autograd.grad((out.double().sum(-1) + lse.double() * weight).sum(), (q, k, v))

    ours = grads(lambda q, k, v: sv.block_sparse_attention(q, k, v, mask, return_lse=True, backend="flash_attn4"),
                 torch.bfloat16)
    ref = grads(lambda q, k, v: sv.block_sparse_attention(q, k, v, mask, return_lse=True, backend="reference"),
                torch.float64)
    low = grads(lambda q, k, v: dense_masked_attention(q, k, v, mask, compute_dtype=torch.bfloat16), torch.bfloat16)
    for g, low_g, ref_g in zip(ours, low, ref):
        assert rel_err(g, ref_g) <= 3 * rel_err(low_g, ref_g)


@pytest.mark.gpu
def test_gradients_for_blocks_its_backward_cannot_tile_are_refused():
    _hopper_with_flash_attn4()
    mask = sv.random_block_mask(1, 2, 1024, 1024, 0.5, 128, 64, device="cuda")
    q, k, v = (torch.randn(1, 2, 1024, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    with pytest.raises(ValueError, match="computes gradients at head dim 128 for key blocks of 128 tokens"):
        sv.block_sparse_attention(q, k, v, mask, backend="flash_attn4")


@pytest.mark.gpu
def test_compiled_training_step_matches_eager():
    _hopper_with_flash_attn4()
    mask = sv.random_block_mask(1, 2, 4096, 4096, 0.8, 128, 128, device="cuda")
    q, k, v = (torch.randn(1, 2, 4096, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    attend = lambda q, k, v: sv.block_sparse_attention(q, k, v, mask, backend="flash_attn4")  # noqa: E731
    eager = torch.autograd.grad(attend(q, k, v).square().sum(), (q, k, v))
    compiled = torch.autograd.grad(torch.compile(attend, fullgraph=True)(q, k, v).square().sum(), (q, k, v))
    for c, e in zip(compiled, eager):
        assert rel_err(c, e) < 1e-2  # dq accumulates by atomics, in no fixed order


@pytest.mark.gpu
def test_compiled_call_matches_eager():
    _hopper_with_flash_attn4()
    mask = sv.random_block_mask(1, 2, 4096, 4096, 0.8, 128, 64, device="cuda")
    q, k, v = (torch.randn(1, 2, 4096, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    attend = lambda q, k, v: sv.block_sparse_attention(q, k, v, mask, backend="flash_attn4")  # noqa: E731
    compiled = torch.compile(attend, fullgraph=True)
    assert torch.equal(compiled(q, k, v), attend(q, k, v))


class _Calls:
    """flash_attn4_attention as block_sparse_attention calls it, counting the calls."""

    def __init__(self, monkeypatch):
        self.count, self._real = 0, attention.flash_attn4_attention
        monkeypatch.setattr(attention, "flash_attn4_attention", self)

    def __call__(self, *args):
        self.count += 1
        return self._real(*args)


@pytest.mark.gpu
def test_auto_runs_it_where_it_can_and_triton_for_the_rest(monkeypatch):
    _hopper_with_flash_attn4()
    calls = _Calls(monkeypatch)
    mask = sv.random_block_mask(1, 2, 2048, 2048, 0.7, 128, 64, device="cuda")
    q, k, v = (torch.randn(1, 2, 2048, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    assert torch.equal(sv.block_sparse_attention(q, k, v, mask), sv.block_sparse_attention(q, k, v, mask,
                                                                                           backend="flash_attn4"))
    assert calls.count == 2
    sv.block_sparse_attention(q, k, v, mask, return_tile_mass=True)  # tile masses: Triton's kernel
    sv.block_sparse_attention(q.float(), k.float(), v.float(), mask)  # float32: Triton
    trainable = [t.clone().requires_grad_() for t in (q, k, v)]  # gradients on 128x64 blocks: Triton
    out = sv.block_sparse_attention(*trainable, mask)
    assert calls.count == 2
    assert torch.equal(out, sv.block_sparse_attention(q, k, v, mask, backend="triton"))


@pytest.mark.gpu
def test_a_mask_broadcast_over_batch_and_heads():
    _hopper_with_flash_attn4()
    mask = sv.random_block_mask(1, 1, 1500, 1500, 0.6, 128, 128, device="cuda")
    q, k, v = (torch.randn(2, 3, 1500, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    grad_out = torch.randn_like(q)
    out = sv.block_sparse_attention(q, k, v, mask, backend="flash_attn4")
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out = sv.block_sparse_attention(*ref_in, mask, backend="reference")
    ref_grads = torch.autograd.grad(ref_out, ref_in, grad_out.double())
    low_in = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    low_out = dense_masked_attention(*low_in, mask, compute_dtype=torch.bfloat16)[0]
    low_grads = torch.autograd.grad(low_out, low_in, grad_out)
    assert rel_err(out, ref_out) <= 2 * rel_err(low_out, ref_out)
    for g, low, ref in zip(grads, low_grads, ref_grads):
        assert rel_err(g, ref) <= 3 * rel_err(low, ref)


@pytest.mark.gpu
def test_deterministic_algorithms_keep_gradients_off_its_atomic_backward(monkeypatch):
    _hopper_with_flash_attn4()
    calls = _Calls(monkeypatch)
    mask = sv.random_block_mask(1, 2, 1024, 1024, 0.5, 128, 128, device="cuda")
    q, k, v = (torch.randn(1, 2, 1024, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    try:
        torch.use_deterministic_algorithms(True)
        with pytest.raises(RuntimeError, match="use_deterministic_algorithms"):
            sv.block_sparse_attention(q, k, v, mask, backend="flash_attn4")
        out = sv.block_sparse_attention(q, k, v, mask)  # "auto": the Triton kernels
        assert calls.count == 0 and torch.equal(out, sv.block_sparse_attention(q, k, v, mask, backend="triton"))
        torch.use_deterministic_algorithms(True, warn_only=True)
        with pytest.warns(UserWarning, match="not deterministic"):
            sv.block_sparse_attention(q, k, v, mask, backend="flash_attn4")
    finally:
        torch.use_deterministic_algorithms(False)
