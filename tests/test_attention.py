"""block_sparse_attention on the CPU: the reference backend against a float64 oracle, the Triton kernels
(under TRITON_INTERPRET=1) and FlexAttention against the reference, forward, LSE and gradients."""
from __future__ import annotations

import pytest
import torch

import sparsevid as sv
from sparsevid.ops import triton_attention
from oracles import ATTENTION_SHAPES, DEVICE, dense_masked_attention, rel_err

SHAPES = ATTENTION_SHAPES


def make_mask(kind: str, b: int, h: int, n: int, m: int, block_q: int, block_k: int) -> sv.SparseMask:
    """Masks that break kernels: random, full, a single tile, rows with no kept tile, per-(b, h) maps."""
    qb, kb = -(-n // block_q), -(-m // block_k)
    if kind == "full":
        return sv.SparseMask.full(n, m, block_q, block_k, device=DEVICE)
    if kind == "single":
        keep = torch.zeros(1, 1, qb, kb, dtype=torch.bool)
        keep[0, 0, qb // 2, kb - 1] = True  # the short last key block
        return sv.SparseMask.from_dense(keep.to(DEVICE), n, m, block_q, block_k)
    keep = torch.rand(b, h, qb, kb) < 0.5
    if kind == "empty-rows":
        keep[..., 0, :] = False
    return sv.SparseMask.from_dense(keep.to(DEVICE), n, m, block_q, block_k)


def rand_inputs(b, h, n, m, d, dtype, requires_grad=True):
    return [torch.randn(b, h, t, d, dtype=dtype, device=DEVICE, requires_grad=requires_grad) for t in (n, m, m)]


def run(q, k, v, mask, backend, grad_out):
    out, lse = sv.block_sparse_attention(q, k, v, mask, return_lse=True, backend=backend)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    return out, lse, grads


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind", ["random", "empty-rows", "single", "full"])
def test_reference_matches_float64_oracle(shape, kind):
    b, h, n, m, d, block_q, block_k = shape
    mask = make_mask(kind, b, h, n, m, block_q, block_k)
    q, k, v = rand_inputs(b, h, n, m, d, torch.float64)
    grad_out = torch.randn(b, h, n, d, dtype=torch.float64, device=DEVICE)
    out, lse, grads = run(q, k, v, mask, "reference", grad_out)
    ref_out, ref_lse = dense_masked_attention(q, k, v, mask)
    ref_grads = torch.autograd.grad(ref_out, (q, k, v), grad_out)
    assert rel_err(out, ref_out) < 1e-12
    assert rel_err(lse, ref_lse) < 1e-12
    for g, r in zip(grads, ref_grads):
        assert torch.isfinite(g).all()
        assert rel_err(g, r) < 1e-12


def test_reference_chunks_long_sequences(monkeypatch):
    """Chunking over query blocks gives the same result as one chunk."""
    from sparsevid.ops import reference

    b, h, n, m, d = 1, 2, 700, 500, 32
    mask = make_mask("random", b, h, n, m, 64, 64)
    q, k, v = rand_inputs(b, h, n, m, d, torch.float64, requires_grad=False)
    whole = sv.block_sparse_attention(q, k, v, mask, backend="reference")
    monkeypatch.setattr(reference, "_MAX_CHUNK_ELEMENTS", 64 * m * b * h)  # one query block per chunk
    assert torch.equal(sv.block_sparse_attention(q, k, v, mask, backend="reference"), whole)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind", ["random", "empty-rows", "single", "full"])
@pytest.mark.parametrize("tma", [True, False], ids=["tma", "pointers"])
def test_triton_float32_matches_oracle(shape, kind, tma, nan_poisoned_outputs, monkeypatch):
    """Both ways of reading K/V (Q/dO): tensor descriptors where the inputs allow (head dims 16..128 that are
    powers of two here; d80 always takes pointer loads) and plain pointer loads."""
    monkeypatch.setattr(triton_attention, "TMA", triton_attention.tma_kernels("all" if tma else "none"))
    b, h, n, m, d, block_q, block_k = shape
    mask = make_mask(kind, b, h, n, m, block_q, block_k)
    q, k, v = rand_inputs(b, h, n, m, d, torch.float32)
    grad_out = torch.randn(b, h, n, d, device=DEVICE)
    out, lse, grads = run(q, k, v, mask, "triton", grad_out)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref_out, ref_lse = dense_masked_attention(q64, k64, v64, mask)
    ref_grads = torch.autograd.grad(ref_out, (q64, k64, v64), grad_out.double())
    # float32 arithmetic throughout: errors far below 1e-4 (DESIGN.md section 3).
    assert rel_err(out, ref_out) < 1e-5
    assert rel_err(lse, ref_lse) < 1e-5
    for g, r in zip(grads, ref_grads):
        assert rel_err(g, r) < 1e-5


@pytest.mark.parametrize("shape", SHAPES[:4])
def test_triton_float16_within_budget_of_plain_pytorch(shape, nan_poisoned_outputs):
    """fp16 kernel error is at most 2x (outputs) / 3x (gradients) what plain PyTorch makes in fp16."""
    b, h, n, m, d, block_q, block_k = shape
    mask = make_mask("random", b, h, n, m, block_q, block_k)
    q, k, v = (t.half().detach().requires_grad_() for t in rand_inputs(b, h, n, m, d, torch.float32))
    grad_out = torch.randn(b, h, n, d, device=DEVICE).half()
    out, lse, grads = run(q, k, v, mask, "triton", grad_out)

    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref_out, ref_lse = dense_masked_attention(q64, k64, v64, mask)
    ref_grads = torch.autograd.grad(ref_out, (q64, k64, v64), grad_out.double())
    q16, k16, v16 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    torch_out, _ = dense_masked_attention(q16, k16, v16, mask, compute_dtype=torch.float16)
    torch_grads = torch.autograd.grad(torch_out, (q16, k16, v16), grad_out)

    assert rel_err(out, ref_out) <= 2 * rel_err(torch_out, ref_out)
    assert rel_err(lse, ref_lse) < 1e-5  # lse is accumulated in float32
    for g, tg, r in zip(grads, torch_grads, ref_grads):
        assert rel_err(g, r) <= 3 * rel_err(tg, r)


def test_rows_without_tiles_give_zeros_and_zero_gradients(nan_poisoned_outputs):
    b, h, n, m, d = 1, 2, 300, 260, 64
    keep = torch.rand(b, h, 3, 5, device=DEVICE) < 0.6
    keep[:, :, 1, :] = False  # query block 1 attends nothing
    keep[:, :, :, 2] = False  # key block 2 is attended by nothing
    mask = sv.SparseMask.from_dense(keep, n, m, 128, 64)
    q, k, v = rand_inputs(b, h, n, m, d, torch.float32)
    out, lse, (dq, dk, dv) = run(q, k, v, mask, "triton", torch.randn(b, h, n, d, device=DEVICE))
    assert torch.equal(out[:, :, 128:256], torch.zeros_like(out[:, :, 128:256]))
    assert torch.isneginf(lse[:, :, 128:256]).all()
    # Per (batch, head): block 0's rows have a finite lse exactly when that head keeps a tile in row 0.
    assert torch.equal(torch.isfinite(lse[:, :, :128]).all(dim=-1), keep[:, :, 0].any(dim=-1))
    assert torch.equal(dq[:, :, 128:256], torch.zeros_like(dq[:, :, 128:256]))
    assert torch.equal(dk[:, :, 128:192], torch.zeros_like(dk[:, :, 128:192]))
    assert torch.equal(dv[:, :, 128:192], torch.zeros_like(dv[:, :, 128:192]))
    assert all(torch.isfinite(t).all() for t in (out, dq, dk, dv))


def test_tensor_descriptors_only_for_aligned_power_of_two_head_dims(monkeypatch):
    q = torch.randn(1, 2, 100, 64, device=DEVICE)
    assert triton_attention._use_tma("fwd", q) == (DEVICE == "cpu" or torch.cuda.get_device_capability()[0] >= 9)
    assert not triton_attention._use_tma("fwd", torch.randn(1, 2, 100, 80, device=DEVICE))  # head dim 80
    wide = torch.randn(1, 2, 100, 66, device=DEVICE)
    assert not triton_attention._use_tma("fwd", wide[..., 1:65])  # base 4 bytes past alignment
    monkeypatch.setattr(triton_attention, "TMA", triton_attention.tma_kernels("dq,dkdv"))
    assert not triton_attention._use_tma("fwd", q)
    with pytest.raises(ValueError, match="SPARSEVID_TMA"):
        triton_attention.tma_kernels("fwd,bwd")


def test_full_mask_equals_dense_sdpa():
    b, h, n, d = 2, 2, 333, 64
    q, k, v = rand_inputs(b, h, n, n, d, torch.float32, requires_grad=False)
    mask = sv.SparseMask.full(n, n, 128, 64, device=DEVICE)
    expected = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double())
    for backend in ("reference", "triton"):
        assert rel_err(sv.block_sparse_attention(q, k, v, mask, backend=backend), expected) < 1e-5


def test_strided_inputs_need_no_copy_and_keep_layout():
    """[B, N, H, D] tensors transposed to [B, H, N, D] are read in place; the output keeps that layout."""
    b, h, n, d = 2, 3, 200, 64
    q, k, v = (torch.randn(b, n, h, d, device=DEVICE).transpose(1, 2) for _ in range(3))
    mask = make_mask("random", b, h, n, n, 64, 64)
    out = sv.block_sparse_attention(q, k, v, mask, backend="triton")
    assert out.stride() == q.stride()
    expected = sv.block_sparse_attention(*(t.contiguous() for t in (q, k, v)), mask, backend="reference")
    assert rel_err(out, expected) < 1e-5


def test_scale_and_gradient_through_lse():
    b, h, n, d = 1, 2, 150, 32
    mask = make_mask("random", b, h, n, n, 64, 64)
    q, k, v = rand_inputs(b, h, n, n, d, torch.float32)
    grads = {}
    for backend in ("reference", "triton"):
        out, lse = sv.block_sparse_attention(q, k, v, mask, scale=0.3, return_lse=True, backend=backend)
        loss = (out * out).sum() + (lse.masked_fill(torch.isinf(lse), 0) ** 2).sum()
        grads[backend] = torch.autograd.grad(loss, (q, k, v))
    for g, r in zip(grads["triton"], grads["reference"]):
        assert rel_err(g, r) < 1e-5


@pytest.mark.parametrize("shape", SHAPES[:3])
def test_flex_backend_matches_reference(shape):
    """Forward only: PyTorch's FlexAttention has no backward on the CPU (the GPU tests cover it)."""
    b, h, n, m, d, block_q, block_k = shape
    mask = make_mask("random", b, h, n, m, block_q, block_k)
    q, k, v = rand_inputs(b, h, n, m, d, torch.float32, requires_grad=False)
    out, lse = sv.block_sparse_attention(q, k, v, mask, return_lse=True, backend="flex")
    ref_out, ref_lse = sv.block_sparse_attention(q, k, v, mask, return_lse=True, backend="reference")
    assert rel_err(out, ref_out) < 1e-5
    assert rel_err(lse, ref_lse) < 1e-5


def test_custom_op_passes_opcheck():
    """Schema, fake (meta) implementation and autograd registration are consistent for torch.compile."""
    b, h, n, d = 1, 2, 130, 32
    mask = make_mask("random", b, h, n, n, 64, 64)
    q, k, v = rand_inputs(b, h, n, n, d, torch.float32)
    args = (q, k, v, mask.kv_count, mask.kv_index, mask.q_count, mask.q_index, 64, 64, d ** -0.5)
    torch.library.opcheck(torch.ops.sparsevid.block_sparse_attn.default, args)


def test_torch_compile_traces_through_the_op():
    b, h, n, d = 1, 2, 130, 32
    mask = make_mask("random", b, h, n, n, 64, 64)
    q, k, v = rand_inputs(b, h, n, n, d, torch.float32, requires_grad=False)

    def layer(q, k, v):
        return sv.block_sparse_attention(q * 2.0, k, v, mask, backend="triton").relu()

    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    assert rel_err(compiled(q, k, v), layer(q, k, v)) < 1e-6


def test_auto_backend_is_gather_on_cpu():
    from sparsevid.ops import attention

    q = torch.randn(1, 1, 10, 16)
    assert attention.resolve_backend("auto", q) == "gather"


# ----------------------------------------------------------------------------- bad input

def _good():
    q, k, v = rand_inputs(1, 2, 100, 100, 32, torch.float32, requires_grad=False)
    return q, k, v, make_mask("random", 1, 2, 100, 100, 64, 64)


@pytest.mark.parametrize("mutate, error, message", [
    (lambda q, k, v, m: (q[0], k, v, m), ValueError, "q must have shape"),
    (lambda q, k, v, m: (q, k.half(), v, m), TypeError, "share one dtype"),
    (lambda q, k, v, m: (q.long(), k, v, m), TypeError, "floating-point"),
    (lambda q, k, v, m: (q, k[:, :1], v[:, :1], m), ValueError, "share \\[B, H\\]"),
    (lambda q, k, v, m: (q, k, v[:, :, :50], m), ValueError, "same shape"),
    (lambda q, k, v, m: (q, k, v[..., :16], m), ValueError, "head dim D"),
    (lambda q, k, v, m: (q[:, :, :90], k, v, m), ValueError, "q_len=100"),
    (lambda q, k, v, m: (q, k, v, m.keep), TypeError, "SparseMask"),
    (lambda q, k, v, m: (q, k, v, sv.random_block_mask(3, 2, 100, 100, 0.5, 64, 64, device=DEVICE)), ValueError,
     "broadcast"),
    (lambda q, k, v, m: (q, k, v, m.to("meta")), ValueError, "mask is on meta"),
])
def test_bad_inputs_raise_clear_errors(mutate, error, message):
    with pytest.raises(error, match=message):
        sv.block_sparse_attention(*mutate(*_good()))


def test_bad_backend_and_scale():
    q, k, v, mask = _good()
    with pytest.raises(ValueError, match="backend must be one of"):
        sv.block_sparse_attention(q, k, v, mask, backend="cuda")
    with pytest.raises(ValueError, match="scale must be"):
        sv.block_sparse_attention(q, k, v, mask, scale=-1.0)
    with pytest.raises(ValueError, match="scale must be None or a positive finite number"):  # else all-NaN rows
        sv.block_sparse_attention(q, k, v, mask, scale=float("inf"), backend="reference")
    with pytest.raises(TypeError, match="supports dtypes"):
        sv.block_sparse_attention(q.double(), k.double(), v.double(), mask, backend="triton")


def test_flex_gradients_on_the_cpu_are_refused_before_torch_fails():
    q, k, v, mask = _good()
    q.requires_grad_(True)
    with pytest.raises(ValueError, match="backend='flex' computes gradients only on CUDA"):
        sv.block_sparse_attention(q, k, v, mask, backend="flex")
    with torch.no_grad():  # inference still runs
        assert sv.block_sparse_attention(q, k, v, mask, backend="flex").shape == q.shape


@pytest.mark.parametrize("flag", ["return_lse", "return_tile_mass"])
def test_return_flags_insist_on_bool(flag):
    q, k, v, mask = _good()
    with pytest.raises(TypeError, match=f"{flag} must be a bool"):
        sv.block_sparse_attention(q, k, v, mask, backend="reference", **{flag: "yes"})


def test_the_plain_pytorch_backend_is_called_reference_everywhere():
    q, k, v, mask = _good()
    with pytest.raises(ValueError, match="called 'reference'"):
        sv.block_sparse_attention(q, k, v, mask, backend="torch")
    with pytest.raises(ValueError, match="called 'reference'"):
        sv.SparseConfig(backend="torch")
    reference, _ = sv.predict_mask(q, k, block_q=64, block_k=64, backend="reference")
    with pytest.warns(FutureWarning, match="called 'reference'"):
        renamed, _ = sv.predict_mask(q, k, block_q=64, block_k=64, backend="torch")
    assert torch.equal(renamed.keep, reference.keep)
