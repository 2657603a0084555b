"""The "gather" backend (kept tiles only, the default off CUDA) against a float64 oracle: forward, lse,
gradients (with and without an lse gradient), tile masses, odd shapes, broadcast masks, strided inputs, NaN
rows and chunking; both ways it runs a chunk (PyTorch's fused CPU attention kernel and plain matrix products).
"""
from __future__ import annotations

import pytest
import torch

import sparsevid as sv
from sparsevid.ops import attention, gather_attention
from oracles import ATTENTION_SHAPES, dense_masked_attention, rel_err

# The kernel tests' shapes with a head dim 128 at 128x64 blocks added (the demo's blocks).
SHAPES = [*ATTENTION_SHAPES[:4], pytest.param((1, 2, 256, 384, 128, 128, 64), id="even-d128-128x64"),
          *ATTENTION_SHAPES[4:]]
KINDS = ["random", "empty-rows", "whole-rows", "single", "full"]
# Relative error vs float64 (DESIGN.md section 3): float32 arithmetic lands far below 1e-4.
TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5}
CPU = "cpu"


def use_matmul_path(monkeypatch) -> None:
    """Run each chunk through plain matrix products (what devices other than the CPU run) instead of PyTorch's
    fused CPU attention kernel."""
    monkeypatch.setattr(gather_attention, "_fused_kernel_runs_on", lambda t: False)


@pytest.fixture(params=["fused", "matmul"])
def chunk_path(request, monkeypatch):
    """Both ways of running a chunk: the fused CPU kernel (the default on the CPU) and matrix products."""
    if request.param == "matmul":
        use_matmul_path(monkeypatch)
    return request.param


@pytest.fixture
def nan_poisoned_outputs(monkeypatch):
    """Outputs the passes must write in full (out, lse, dq) start as NaN, so an element left out shows up."""
    original = gather_attention._alloc
    monkeypatch.setattr(gather_attention, "_alloc", lambda *a, **kw: original(*a, **kw).fill_(float("nan")))


def make_mask(kind: str, b: int, h: int, n: int, m: int, block_q: int, block_k: int) -> sv.SparseMask:
    """Random (per batch entry and head), full, a single tile (the short last key block), random with the
    first query block keeping nothing, or random with the last query block keeping every key block (and, in
    the first head, the first one too: heads with different numbers of such rows)."""
    qb, kb = -(-n // block_q), -(-m // block_k)
    if kind == "full":
        return sv.SparseMask.full(n, m, block_q, block_k)
    if kind == "single":
        keep = torch.zeros(1, 1, qb, kb, dtype=torch.bool)
        keep[0, 0, qb // 2, kb - 1] = True
        return sv.SparseMask.from_dense(keep, n, m, block_q, block_k)
    keep = torch.rand(b, h, qb, kb) < 0.5
    if kind == "empty-rows":
        keep[..., 0, :] = False
    if kind == "whole-rows":
        keep[..., -1, :] = True
        keep[0, 0, 0, :] = True
    return sv.SparseMask.from_dense(keep, n, m, block_q, block_k)


def rand_inputs(b, h, n, m, d, dtype, requires_grad=True):
    return [torch.randn(b, h, t, d, dtype=dtype, requires_grad=requires_grad) for t in (n, m, m)]


def oracle(q, k, v, mask, grad_out, grad_lse=None, scale=None):
    """float64 out, lse and the gradients of sum(out * grad_out) (+ sum(lse * grad_lse) over finite lse)."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    out, lse = dense_masked_attention(*leaves, mask, scale=scale)
    return out, lse, torch.autograd.grad(_loss(out, lse, grad_out, grad_lse), leaves)


def _loss(out, lse, grad_out, grad_lse):
    loss = (out * grad_out.to(out.dtype)).sum()
    if grad_lse is not None:
        loss = loss + torch.where(torch.isfinite(lse), lse, 0.0).mul(grad_lse.to(lse.dtype)).sum()
    return loss


def run_gather(q, k, v, mask, grad_out, grad_lse=None, scale=None):
    out, lse = sv.block_sparse_attention(q, k, v, mask, scale=scale, return_lse=True, backend="gather")
    return out, lse, torch.autograd.grad(_loss(out, lse, grad_out, grad_lse), (q, k, v))


def assert_close(got, expected, tolerance):
    out, lse, grads = got
    ref_out, ref_lse, ref_grads = expected
    assert rel_err(out, ref_out) < tolerance
    assert rel_err(lse, ref_lse) < tolerance
    for g, r in zip(grads, ref_grads):
        assert torch.isfinite(g).all()
        assert rel_err(g, r) < 3 * tolerance


@pytest.mark.parametrize("path, dtype", [("fused", torch.float32), ("fused", torch.float64),
                                         ("matmul", torch.float32)], ids=["fused-fp32", "fused-fp64", "matmul-fp32"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", SHAPES)
def test_gather_matches_float64_oracle(shape, kind, path, dtype, monkeypatch, nan_poisoned_outputs):
    if path == "matmul":
        use_matmul_path(monkeypatch)
    b, h, n, m, d, block_q, block_k = shape
    mask = make_mask(kind, b, h, n, m, block_q, block_k)
    q, k, v = rand_inputs(b, h, n, m, d, dtype)
    grad_out = torch.randn(b, h, n, d, dtype=dtype)
    got = run_gather(q, k, v, mask, grad_out)
    assert got[0].dtype == dtype and got[0].shape == (b, h, n, d)
    assert got[1].dtype == dtype and got[1].shape == (b, h, n)
    assert_close(got, oracle(q, k, v, mask, grad_out), TOLERANCE[dtype])


@pytest.mark.parametrize("shape", SHAPES[:4])
def test_lse_gradient_and_scale(shape, chunk_path, nan_poisoned_outputs):
    """A loss on lse as well as out, with a non-default scale (the fused kernel takes no lse gradient: the
    matrix-product path serves it)."""
    b, h, n, m, d, block_q, block_k = shape
    mask = make_mask("empty-rows", b, h, n, m, block_q, block_k)
    q, k, v = rand_inputs(b, h, n, m, d, torch.float64)
    grad_out, grad_lse = torch.randn(b, h, n, d, dtype=torch.float64), torch.randn(b, h, n, dtype=torch.float64)
    got = run_gather(q, k, v, mask, grad_out, grad_lse, scale=0.3)
    assert_close(got, oracle(q, k, v, mask, grad_out, grad_lse, scale=0.3), TOLERANCE[torch.float64])


@pytest.mark.parametrize("keep_shape", [(1, 3), (2, 1), (1, 1)], ids=["over-B", "over-H", "over-B-and-H"])
def test_broadcast_masks(keep_shape, chunk_path):
    b, h, n, d = 2, 3, 200, 64
    keep = torch.rand(*keep_shape, 2, 4) < 0.6
    keep[..., 0] = True
    mask = sv.SparseMask.from_dense(keep, n, n, 128, 64)
    q, k, v = rand_inputs(b, h, n, n, d, torch.float64)
    grad_out = torch.randn(b, h, n, d, dtype=torch.float64)
    assert_close(run_gather(q, k, v, mask, grad_out), oracle(q, k, v, mask, grad_out), TOLERANCE[torch.float64])


def test_empty_rows_give_zeros_minus_inf_and_zero_gradients(chunk_path, nan_poisoned_outputs):
    b, h, n, m, d = 1, 2, 300, 260, 64
    keep = torch.rand(b, h, 3, 5) < 0.6
    keep[:, :, 1, :] = False  # query block 1 attends nothing
    keep[:, :, :, 2] = False  # key block 2 is attended by nothing
    keep[:, :, 0, 0] = True
    mask = sv.SparseMask.from_dense(keep, n, m, 128, 64)
    q, k, v = rand_inputs(b, h, n, m, d, torch.float32)
    out, lse, (dq, dk, dv) = run_gather(q, k, v, mask, torch.randn(b, h, n, d))
    assert torch.equal(out[:, :, 128:256], torch.zeros_like(out[:, :, 128:256]))
    assert torch.isneginf(lse[:, :, 128:256]).all() and torch.isfinite(lse[:, :, :128]).all()
    assert torch.equal(dq[:, :, 128:256], torch.zeros_like(dq[:, :, 128:256]))
    assert torch.equal(dk[:, :, 128:192], torch.zeros_like(dk[:, :, 128:192]))
    assert torch.equal(dv[:, :, 128:192], torch.zeros_like(dv[:, :, 128:192]))
    assert all(torch.isfinite(t).all() for t in (out, dq, dk, dv))


@pytest.mark.parametrize("shape", [(2, 2, 333, 333, 64), (1, 2, 256, 300, 128)], ids=["B2-N333-d64", "N256-M300-d128"])
def test_full_mask_equals_dense_sdpa(shape, chunk_path):
    b, h, n, m, d = shape
    q, k, v = rand_inputs(b, h, n, m, d, torch.float32, requires_grad=False)
    mask = sv.SparseMask.full(n, m, 128, 64)
    expected = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double())
    assert rel_err(sv.block_sparse_attention(q, k, v, mask, backend="gather"), expected) < 1e-5


def test_nan_in_a_query_row_gives_a_nan_row(chunk_path):
    b, h, n, d = 1, 2, 200, 64
    mask = make_mask("random", b, h, n, n, 64, 64)
    keep = mask.keep.clone()
    keep[..., 0] = True  # every row keeps a tile
    mask = sv.SparseMask.from_dense(keep, n, n, 64, 64)
    q, k, v = rand_inputs(b, h, n, n, d, torch.float32, requires_grad=False)
    q[0, 1, 70, 5] = float("nan")
    out, lse = sv.block_sparse_attention(q, k, v, mask, return_lse=True, backend="gather")
    assert out[0, 1, 70].isnan().all() and lse[0, 1, 70].isnan()
    rows = torch.ones(b, h, n, dtype=torch.bool)
    rows[0, 1, 70] = False
    assert torch.isfinite(out[rows]).all() and torch.isfinite(lse[rows]).all()


def test_strided_inputs_and_half_precision(chunk_path):
    """[B, N, H, D] tensors transposed to [B, H, N, D] give the contiguous result; fp16/bf16 inputs compute in
    float32 and return their own dtype."""
    b, h, n, d = 2, 3, 300, 64
    mask = make_mask("random", b, h, n, n, 128, 64)
    q, k, v = (torch.randn(b, n, h, d).transpose(1, 2) for _ in range(3))
    expected = sv.block_sparse_attention(*(t.contiguous() for t in (q, k, v)), mask, backend="gather")
    assert torch.equal(sv.block_sparse_attention(q, k, v, mask, backend="gather"), expected)
    ref_out, _ = dense_masked_attention(q, k, v, mask)
    for dtype in (torch.float16, torch.bfloat16):
        out = sv.block_sparse_attention(*(t.to(dtype) for t in (q, k, v)), mask, backend="gather")
        assert out.dtype == dtype
        # Rounding of the operands and the output to 8 (bf16) or 11 (fp16) significant bits.
        assert rel_err(out, ref_out) < (1e-2 if dtype == torch.bfloat16 else 2e-3)


def test_autocast_leaves_the_float32_computation_alone(monkeypatch):
    """Under torch.autocast (a bf16 pipeline) the gather backend still computes in float32 (it crashed once on a
    GPU, its autocast products in bf16 meeting float32 buffers): out and the gradients equal those without
    autocast, on the matrix-product path (the one CUDA takes) and for blocks that keep whole rows."""
    use_matmul_path(monkeypatch)
    b, h, n, d = 1, 2, 300, 64
    for kind in ("random", "whole-rows"):
        mask = make_mask(kind, b, h, n, n, 128, 64)
        q, k, v = rand_inputs(b, h, n, n, d, torch.float32)
        grad_out = torch.randn(b, h, n, d)
        expected = run_gather(q, k, v, mask, grad_out)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = run_gather(q, k, v, mask, grad_out)
        for g, e in zip((got[0], got[1], *got[2]), (expected[0], expected[1], *expected[2])):
            assert g.dtype == torch.float32 and torch.equal(g, e), kind


@pytest.mark.parametrize("kind", ["empty-rows", "whole-rows"])
@pytest.mark.parametrize("shape", SHAPES[:4])
def test_tile_mass_matches_reference(shape, kind, chunk_path):
    b, h, n, m, d, block_q, block_k = shape
    mask = make_mask(kind, b, h, n, m, block_q, block_k)
    q, k, v = rand_inputs(b, h, n, m, d, torch.float64, requires_grad=False)
    out, lse, mass = sv.block_sparse_attention(q, k, v, mask, return_lse=True, return_tile_mass=True,
                                               backend="gather")
    ref_out, ref_lse, ref_mass = sv.block_sparse_attention(q, k, v, mask, return_lse=True, return_tile_mass=True,
                                                           backend="reference")
    assert mass.dtype == torch.float32 and mass.shape == ref_mass.shape
    assert rel_err(out, ref_out) < 1e-12 and rel_err(lse, ref_lse) < 1e-12
    assert (mass - ref_mass).abs().max() < 1e-6
    assert torch.equal(mass > 0, mask.keep.expand_as(mass) & (ref_mass > 0))


def test_chunks_of_different_kept_counts_give_the_same_result(monkeypatch, chunk_path):
    """A budget of one query block per chunk (rows of different kept counts in separate chunks) gives the
    result of one chunk for all; query blocks that keep every key block are never chunked."""
    b, h, n, m, d = 2, 1, 400, 300, 32
    mask = make_mask("whole-rows", b, h, n, m, 64, 64)
    q, k, v = rand_inputs(b, h, n, m, d, torch.float64)
    grad_out = torch.randn(b, h, n, d, dtype=torch.float64)
    whole = run_gather(q, k, v, mask, grad_out)
    monkeypatch.setattr(gather_attention, "_CHUNK_ELEMENTS", 1)
    plan = gather_attention._make_plan(mask, b, h, d, 1.0, torch.float64, q.device)
    assert len(plan.chunks) == int(((mask.kv_count > 0) & (mask.kv_count < mask.num_kv_blocks)).sum())
    chunked = run_gather(q, k, v, mask, grad_out)
    for got, expected in zip([chunked[0], chunked[1], *chunked[2]], [whole[0], whole[1], *whole[2]]):
        assert rel_err(got, expected) < 1e-12


@pytest.mark.parametrize("whole_rows", [True, False], ids=["whole-rows-apart", "all-chunked"])
def test_plan_covers_every_query_block_once_with_bounded_padding(whole_rows):
    """Empty, chunked and whole query blocks partition the rows; a chunk pads at most max(kept tiles /
    _PADDING_SHARE, _FREE_PADDING_TILES) tiles; whole rows are grouped by their count per head."""
    b, h, qb, kb = 2, 3, 40, 24
    keep = torch.rand(b, h, qb, kb) < torch.rand(b, h, qb, 1)  # rows keep from none to all key blocks
    keep[0, 1, :5] = True
    mask = sv.SparseMask.from_dense(keep, qb * 64, kb * 64, 64, 64)
    plan = gather_attention._make_plan(mask, b, h, 64, 1.0, torch.float32, torch.device(CPU), whole_rows=whole_rows)
    count = mask.kv_count.reshape(-1)
    chunked = torch.cat([c.rows for c in plan.chunks])
    assert torch.equal(chunked, plan.rows)
    whole = [w.rows for w in plan.whole_rows]
    every = torch.cat([plan.empty_rows, chunked, *whole]).sort().values
    assert torch.equal(every, torch.arange(b * h * qb))
    assert bool((count[plan.empty_rows] == 0).all())
    for chunk in plan.chunks:
        kept = count[chunk.rows]
        assert int(kept.max()) == chunk.slots
        padding = len(kept) * chunk.slots - int(kept.sum())
        assert padding <= max(int(kept.sum()) // gather_attention._PADDING_SHARE,
                              gather_attention._FREE_PADDING_TILES)
    assert len(plan.chunks) < len(torch.unique(count[plan.rows]))  # rows of different counts share chunks
    if whole_rows:
        assert all(bool((count[w] == kb).all()) for w in whole) and not bool((count[chunked] == kb).any())
        whole_per_head = (mask.kv_count == kb).sum(-1).reshape(-1)
        for group in plan.whole_rows:  # every head of a group has the group's number of whole rows
            assert torch.equal(torch.unique(group.rows // qb), group.heads)
            assert bool((whole_per_head[group.heads] * len(group.heads) == len(group.rows)).all())
        sizes = [len(g.rows) // len(g.heads) for g in plan.whole_rows]
        assert len(set(sizes)) == len(sizes) and 5 <= max(sizes)
    else:
        assert not plan.whole_rows


def test_auto_backend_is_gather_off_cuda():
    q = torch.randn(1, 1, 10, 16)
    assert attention.resolve_backend("auto", q) == "gather"
    assert attention.resolve_backend("auto", q.double()) == "gather"
    mask = make_mask("random", 1, 1, 10, 10, 64, 64)
    out = sv.block_sparse_attention(q, q, q, mask)
    assert torch.equal(out, sv.block_sparse_attention(q, q, q, mask, backend="gather"))


def test_tile_mass_with_gradients_is_refused():
    q, k, v = rand_inputs(1, 1, 100, 100, 16, torch.float32)
    with pytest.raises(ValueError, match="inference only"):
        sv.block_sparse_attention(q, k, v, make_mask("random", 1, 1, 100, 100, 64, 64), return_tile_mass=True,
                                  backend="gather")


def test_the_gather_op_passes_opcheck_and_compiles_with_gradients():
    """The gather backend's custom op (what torch.compile traces on the CPU): schema, fake and autograd agree, and
    a compiled function gives the eager values and gradients."""
    b, h, n, m, d = 2, 2, 200, 333, 32
    mask = make_mask("random", b, h, n, m, 64, 64)
    q, k, v = rand_inputs(b, h, n, m, d, torch.float32)
    args = (q, k, v, mask.keep, n, m, 64, 64, d ** -0.5)
    torch.library.opcheck(torch.ops.sparsevid.gather_block_sparse_attn.default, args)

    def layer(q, k, v):
        out, lse = sv.block_sparse_attention(q, k, v, mask, backend="gather", return_lse=True)
        return out.square().sum() + lse.sum()

    eager = torch.autograd.grad(layer(q, k, v), (q, k, v))
    torch._dynamo.reset()
    compiled = torch.autograd.grad(torch.compile(layer, backend="aot_eager", fullgraph=True)(q, k, v), (q, k, v))
    for got, want in zip(compiled, eager):
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
