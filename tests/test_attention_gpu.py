"""block_sparse_attention on a CUDA GPU at real sizes in bf16 (skipped without CUDA).

Error budget (DESIGN.md section 3): the kernel's relative error vs float64 is at most 2x (outputs) and
3x (gradients) the error of plain PyTorch attention computed in bf16 on the same inputs.
"""
from __future__ import annotations

import pytest
import torch

import sparsevid as sv
from oracles import GPU_ATTENTION_CASES, dense_masked_attention, rel_err

pytestmark = pytest.mark.gpu

def _inputs(b, h, n, m, d):
    q, k, v = (torch.randn(b, h, t, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for t in (n, m, m))
    return q, k, v, torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16)


@pytest.mark.parametrize("case, backend",
                         [pytest.param(c.values[0], "triton", id=f"triton-{c.id}") for c in GPU_ATTENTION_CASES]
                         + [pytest.param(GPU_ATTENTION_CASES[1].values[0], "flex",
                                         id=f"flex-{GPU_ATTENTION_CASES[1].id}")])
def test_bf16_within_budget_of_plain_pytorch(case, backend):
    b, h, n, m, d, block_q, block_k, sparsity = case
    mask = sv.random_block_mask(b, h, n, m, sparsity, block_q, block_k, device="cuda")
    q, k, v, grad_out = _inputs(b, h, n, m, d)
    out, lse = sv.block_sparse_attention(q, k, v, mask, return_lse=True, backend=backend)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)

    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = sv.block_sparse_attention(*ref_in, mask, return_lse=True, backend="reference")
    ref_grads = torch.autograd.grad(ref_out, ref_in, grad_out.double())
    low_in = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    low_out, _ = dense_masked_attention(*low_in, mask, compute_dtype=torch.bfloat16)
    low_grads = torch.autograd.grad(low_out, low_in, grad_out)

    assert rel_err(out, ref_out) <= 2 * rel_err(low_out, ref_out)
    assert rel_err(lse, ref_lse) < 1e-3
    for g, low, ref in zip(grads, low_grads, ref_grads):
        assert rel_err(g, ref) <= 3 * rel_err(low, ref)


@pytest.mark.parametrize("case", [GPU_ATTENTION_CASES[2], GPU_ATTENTION_CASES[3]])
def test_flex_forward_with_64_blocks_and_its_gradients_refused(case):
    """FlexAttention's forward runs 128x64 and 64x128 masks (tiles pinned to 64) within the bf16 budget; its
    backward cannot tile them, so gradients are refused with a clear error."""
    b, h, n, m, d, block_q, block_k, sparsity = case
    mask = sv.random_block_mask(b, h, n, m, sparsity, block_q, block_k, device="cuda")
    q, k, v, _ = _inputs(b, h, n, m, d)
    with pytest.raises(ValueError, match="gradients only for 128x128 blocks"):
        sv.block_sparse_attention(q, k, v, mask, backend="flex")
    with torch.no_grad():
        out = sv.block_sparse_attention(q, k, v, mask, backend="flex")
        ref = sv.block_sparse_attention(q.double(), k.double(), v.double(), mask, backend="reference")
        low, _ = dense_masked_attention(q, k, v, mask, compute_dtype=torch.bfloat16)
    assert rel_err(out, ref) <= 2 * rel_err(low, ref)


def test_every_output_element_is_written(monkeypatch):
    from sparsevid.ops import triton_attention

    original = triton_attention._alloc
    monkeypatch.setattr(triton_attention, "_alloc", lambda *a: original(*a).fill_(float("nan")))
    b, h, n, d = 1, 3, 5000, 128
    keep = torch.rand(b, h, 40, 79, device="cuda") < 0.1
    keep[:, :, 7] = False
    mask = sv.SparseMask.from_dense(keep, n, n, 128, 64)
    q, k, v, grad_out = _inputs(b, h, n, n, d)
    out = sv.block_sparse_attention(q, k, v, mask)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    assert all(torch.isfinite(t).all() for t in (out, *grads))
    assert torch.equal(out[:, :, 7 * 128:8 * 128], torch.zeros_like(out[:, :, 7 * 128:8 * 128]))


# --------------------------------------------------------------------------- precision="fp8" (Hopper, Ada)

FP8_CASES = [GPU_ATTENTION_CASES[0],
             pytest.param((1, 2, 32760, 32760, 128, 128, 64, 0.0), id="wan480p-N32760-d128-128x64-full"),
             *GPU_ATTENTION_CASES[2:]]


def quantized_case(case, inputs: str):
    """(mask, q, k, v) of a quantized-kernel test case: a random block mask of the case's sparsity with its second
    row of blocks empty, and bf16 q, k, v on CUDA [B, H, N|M, D] (Gaussian, video-like or with outlier channels)."""
    from benchmarks.bench_attention_fp8 import video_like_inputs

    b, h, n, m, d, block_q, block_k, sparsity = case
    mask = sv.random_block_mask(b, h, n, m, sparsity, block_q, block_k, device="cuda")
    keep = mask.keep.expand(b, h, -1, -1).clone()
    if keep.shape[2] > 2:
        keep[:, :, 1] = False  # an empty row of blocks
    mask = sv.SparseMask.from_dense(keep, n, m, block_q, block_k)
    if inputs == "gaussian":
        return (mask, *(torch.randn(b, h, t, d, device="cuda", dtype=torch.bfloat16) for t in (n, m, m)))
    return (mask, *video_like_inputs(b, h, n, m, d, outlier=inputs == "outlier"))


@pytest.mark.parametrize("inputs", ["gaussian", "video-like", "outlier"])
@pytest.mark.parametrize("case", FP8_CASES)
def test_fp8_kernel_against_emulation(case, inputs, nan_poisoned_outputs):
    """The quantizer matches the PyTorch one bit for bit (given its K mean, whose float32 sum runs in another
    order; power-of-two scales make every division exact); the kernel's lse matches the emulation's (same
    logits, fp32 against float64), its output is within 1.25x of the emulation's error vs float64 (the kernel
    rounds P against a running max, the emulation against the final one); rows with no kept tile give zeros and
    lse -inf. (The issue's accuracy targets against the bf16 kernel are reported by the attention_fp8
    benchmark: on the CPU emulation, with Q in two fp8 terms, cosine 0.9998-0.9999 and relative L1 0.014-0.018 on
    video-like inputs, 0.9989-0.9990 and 0.043-0.046 on Gaussian noise.)"""
    from sparsevid.ops import fp8_reference, triton_fp8_attention

    b, h, n, m, d, block_q, block_k, sparsity = case
    mask, q, k, v = quantized_case(case, inputs)
    scale = d ** -0.5
    with torch.no_grad():
        x = triton_fp8_attention.quantize(q, k, v, block_q, block_k)
        # K's mean: float32 sums in another order than torch's (m terms: within m ulps of max |k|)
        assert (x.k_mean - k.double().mean(dim=2)).abs().max() <= m * 2.0 ** -24 * k.abs().max()
        x_ref = fp8_reference.quantize_fp8(q, k, v, block_q, block_k, k_mean=x.k_mean)
        for name, fast, slow in zip(x._fields, x, x_ref):
            assert torch.equal(fast.float(), slow.float()), name
        out, lse = sv.block_sparse_attention(q, k, v, mask, return_lse=True, backend="triton", precision="fp8")
        emu, emu_lse = fp8_reference.emulate_fp8_attention(x, mask, scale)
        ref = sv.block_sparse_attention(q.double(), k.double(), v.double(), mask, backend="reference")
    assert out.dtype == q.dtype and torch.isfinite(out).all()
    assert rel_err(lse, emu_lse) < 1e-4
    assert rel_err(out, ref) <= 1.25 * rel_err(emu, ref)
    empty = ~mask.keep.any(-1).repeat_interleave(block_q, -1)[..., :n]
    assert torch.equal(out[empty], torch.zeros_like(out[empty])) and (lse[empty] == float("-inf")).all()


def test_fp8_every_output_element_is_written(nan_poisoned_outputs):
    b, h, n, d = 1, 3, 5000, 128
    keep = torch.rand(b, h, 40, 79, device="cuda") < 0.1
    keep[:, :, 7] = False
    mask = sv.SparseMask.from_dense(keep, n, n, 128, 64)
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out, lse = sv.block_sparse_attention(q, k, v, mask, return_lse=True, precision="fp8")
    assert torch.isfinite(out).all() and not torch.isnan(lse).any()
    assert torch.equal(out[:, :, 7 * 128:8 * 128], torch.zeros_like(out[:, :, 7 * 128:8 * 128]))


# --------------------------------------------------------------------------- precision="int8"

INT8_CASES = FP8_CASES + [
    pytest.param((1, 2, 5000, 7333, 128, 128, 64, 0.9), id="N5000-M7333-d128-128x64-90"),
    pytest.param((1, 3, 2048, 1000, 64, 64, 64, 0.7), id="N2048-M1000-d64-64x64"),
]


@pytest.mark.parametrize("inputs", ["gaussian", "video-like", "outlier"])
@pytest.mark.parametrize("case", INT8_CASES)
def test_int8_kernel_against_emulation_and_float64(case, inputs, nan_poisoned_outputs):
    """precision="int8" on the GPU. The quantizer matches the PyTorch one bit for bit given its smoothing
    vector (Q's and K's int8 values and scales, V's e4m3 values and power-of-two scales: every division correctly
    rounded; Q's smoothing shifts within float32 summation error);
    the kernel's lse matches the emulation's (the same int8 logits, fp32 against float64); its output is within
    1.25x of the emulation's error vs float64 (the kernel rounds P against a running max, the emulation against
    the final one), and that error within the budget of two e4m3 operands (V and P): 2 eps, eps = V's own e4m3
    rounding error (about 0.026); rows with no kept tile give zeros and lse -inf; every element is written."""
    from sparsevid.ops import int8, int8_reference, triton_int8_attention

    b, h, n, m, d, block_q, block_k, sparsity = case
    mask, q, k, v = quantized_case(case, inputs)
    scale = d ** -0.5
    with torch.no_grad():
        qx, x = triton_int8_attention.quantize(q, k, v, block_k)
        sampled = k[:, :, int8.smoothing_tokens(m, k.device)].double()
        assert ((x.k_mean - sampled.mean(dim=2)).abs() <= 256 * 2.0 ** -24 * sampled.abs().amax(2)).all()
        x_ref = int8_reference.quantize_int8_kv(k, v, block_k, k_mean=x.k_mean)
        for name, fast, slow in zip(x._fields, x, x_ref):
            assert torch.equal(fast.float(), slow.float()), name
        qx_ref = int8_reference.quantize_int8_q(q, x.k_mean)
        assert torch.equal(qx.q8, qx_ref.q8) and torch.equal(qx.q_scale, qx_ref.q_scale)
        # q . mu: float32 sums in another order, within D roundings of the sum of magnitudes
        bound = d * 2.0 ** -24 * (q.float().abs() * x.k_mean.abs()[:, :, None]).sum(-1)
        assert ((qx.q_shift - qx_ref.q_shift).abs() <= bound).all()
        out, lse = sv.block_sparse_attention(q, k, v, mask, return_lse=True, backend="triton", precision="int8")
        emu, emu_lse = int8_reference.emulate_int8_attention(q, x, mask, scale)
        ref = sv.block_sparse_attention(q.double(), k.double(), v.double(), mask, backend="reference")
        eps = rel_err(x_ref.v8.double() * x_ref.v_scale.double()[:, :, None, None], v)
    assert out.dtype == q.dtype and torch.isfinite(out).all()
    assert rel_err(lse, emu_lse) < 1e-4
    assert rel_err(out, ref) <= 1.25 * rel_err(emu, ref)
    assert rel_err(out, ref) <= 2 * eps
    empty = ~mask.keep.any(-1).repeat_interleave(block_q, -1)[..., :n]
    assert torch.equal(out[empty], torch.zeros_like(out[empty])) and (lse[empty] == float("-inf")).all()


def test_int8_nonfinite_v_gives_nan_rows_of_its_tile_only(nan_poisoned_outputs):
    """An inf in V becomes NaN in V8 (V's head scale ignores it): the rows that keep its block are NaN, the others
    as without it (on the CPU the interpreter casts NaN to e4m3 as a number, and the emulation's dense product
    spreads 0 * NaN to every row)."""
    b, h, n, m, d = 1, 1, 256, 512, 64
    q, k, v = (torch.randn(b, h, t, d, device="cuda", dtype=torch.bfloat16) for t in (n, m, m))
    keep = torch.zeros(1, 1, 2, 8, dtype=torch.bool, device="cuda")
    keep[..., 0, :2] = True
    keep[..., 1, 2:4] = True
    mask = sv.SparseMask.from_dense(keep, n, m, 128, 64)
    poisoned = v.clone()
    poisoned[0, 0, 70, 1] = float("inf")  # key block 1, kept by query block 0
    with torch.no_grad():
        clean = sv.block_sparse_attention(q, k, v, mask, precision="int8")
        out = sv.block_sparse_attention(q, k, poisoned, mask, precision="int8")
    assert torch.isnan(out[0, 0, :128]).any(-1).all()
    assert torch.equal(out[0, 0, 128:], clean[0, 0, 128:])


def test_int8_full_mask_matches_dense_attention(nan_poisoned_outputs):
    """With every tile kept the int8 forward is dense attention within its budget (V and P in e4m3)."""
    b, h, n, d = 1, 2, 4133, 128
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    mask = sv.SparseMask.full(n, n, 128, 64, device="cuda")
    with torch.no_grad():
        out = sv.block_sparse_attention(q, k, v, mask, precision="int8")
        dense = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double())
    assert rel_err(out, dense) <= 0.06  # 2 eps
