"""Exact tile masses (``block_sparse_attention(..., return_tile_mass=True)``): the Triton forward (interpreted on
the CPU) and the reference backend against masses summed from dense float64 attention probabilities."""
from __future__ import annotations

import pytest
import torch

import sparsevid as sv
from sparsevid.ops import triton_attention
from sparsevid.ops.mask import expand_block_mask
from oracles import DEVICE, rel_err

# (B, H, N, M, D, block_q, block_k): odd lengths, N != M, N below one block, B > 1, 64/128 blocks.
SHAPES = [
    pytest.param((1, 2, 333, 200, 64, 128, 64), id="N333-M200-128x64"),
    pytest.param((2, 1, 200, 333, 128, 64, 128), id="B2-N200-M333-d128-64x128"),
    pytest.param((1, 1, 50, 70, 32, 64, 64), id="N-below-block-64x64"),
    pytest.param((1, 2, 256, 256, 64, 128, 128), id="even-128x128"),
]


def make_mask(kind, b, h, n, m, block_q, block_k):
    qb, kb = -(-n // block_q), -(-m // block_k)
    if kind == "full":
        return sv.SparseMask.full(n, m, block_q, block_k, device=DEVICE)
    keep = torch.rand(b, h, qb, kb) < 0.5
    keep[..., -1, -1] = True          # the short corner tile is always in play
    if qb > 1:
        keep[..., 0, :] = False       # a query block with no kept tile
    return sv.SparseMask.from_dense(keep.to(DEVICE), n, m, block_q, block_k)


def dense_tile_mass(q, k, mask, scale=None):
    """float64 [B, H, QB, KB]: per tile, the mean over its query rows of the dense masked softmax mass
    its keys receive, from float64 scores of the given inputs (summed with explicit tile loops)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = (q.double() @ k.double().transpose(-1, -2)) * scale
    scores = scores.masked_fill(~expand_block_mask(mask), float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    b, h = q.shape[:2]
    qb, kb = mask.num_q_blocks, mask.num_kv_blocks
    mass = torch.zeros(b, h, qb, kb, dtype=torch.float64, device=q.device)
    for i in range(qb):
        rows = slice(i * mask.block_q, min((i + 1) * mask.block_q, mask.q_len))
        for j in range(kb):
            cols = slice(j * mask.block_k, min((j + 1) * mask.block_k, mask.kv_len))
            mass[:, :, i, j] = probs[:, :, rows, cols].sum(dim=(-2, -1)) / (rows.stop - rows.start)
    return mass


def rand_qkv(b, h, n, m, d, dtype):
    # Scaled up so that softmax rows are peaked and the masses differ a lot between tiles.
    return [(3 * torch.randn(b, h, t, d, device=DEVICE)).to(dtype) for t in (n, m, m)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind", ["random", "full"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_triton_tile_mass_matches_dense_float64(shape, kind, dtype, nan_poisoned_outputs):
    b, h, n, m, d, block_q, block_k = shape
    mask = make_mask(kind, b, h, n, m, block_q, block_k)
    q, k, v = rand_qkv(b, h, n, m, d, dtype)
    out, lse, mass = sv.block_sparse_attention(q, k, v, mask, return_lse=True, return_tile_mass=True,
                                               backend="triton")
    expected = dense_tile_mass(q, k, mask)
    assert mass.dtype == torch.float32 and mass.shape == expected.shape
    # Scores are accumulated in float32 from the very values the oracle reads (fp16 inputs are exact in
    # float64), so only float32 rounding of scores up to ~30 separates them: a few 1e-6 of a row's unit mass at most.
    assert (mass.double() - expected).abs().max() < 5e-6
    assert torch.equal(mass[~mask.keep.expand_as(mass)], torch.zeros_like(mass[~mask.keep.expand_as(mass)]))
    # The variant's out and lse are those of the plain forward, up to the output dtype's rounding (on a GPU
    # the two are tuned separately and may accumulate in another order).
    plain_out, plain_lse = sv.block_sparse_attention(q, k, v, mask, return_lse=True, backend="triton")
    assert rel_err(out, plain_out) < (1e-6 if dtype == torch.float32 else 2e-3)
    assert rel_err(lse, plain_lse) < 1e-6


@pytest.mark.parametrize("shape", SHAPES)
def test_reference_tile_mass_equals_brute_force(shape):
    b, h, n, m, d, block_q, block_k = shape
    mask = make_mask("random", b, h, n, m, block_q, block_k)
    q, k, v = rand_qkv(b, h, n, m, d, torch.float64)
    out, mass = sv.block_sparse_attention(q, k, v, mask, scale=0.2, return_tile_mass=True, backend="reference")
    assert torch.equal(out, sv.block_sparse_attention(q, k, v, mask, scale=0.2, backend="reference"))
    # float64 probabilities, tile sums rounded once to float32 at the end.
    assert (mass.double() - dense_tile_mass(q, k, mask, scale=0.2)).abs().max() < 1e-7


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_masses_of_a_row_block_sum_to_one_over_kept_tiles(backend):
    b, h, n, m, d = 2, 3, 333, 200, 64
    mask = make_mask("random", b, h, n, m, 64, 64)
    q, k, v = rand_qkv(b, h, n, m, d, torch.float32)
    _, mass = sv.block_sparse_attention(q, k, v, mask, return_tile_mass=True, backend=backend)
    has_tiles = mask.keep.expand(b, h, -1, -1).any(dim=-1)
    totals = mass.double().sum(dim=-1)
    assert (totals[has_tiles] - 1).abs().max() < 1e-5
    assert torch.equal(totals[~has_tiles], torch.zeros_like(totals[~has_tiles]))


def test_triton_and_reference_masses_agree_with_broadcast_mask_and_strided_inputs():
    b, h, n, d = 2, 3, 200, 64
    q, k, v = (3 * torch.randn(b, n, h, d, device=DEVICE)).transpose(1, 2), *rand_qkv(b, h, n, n, d, torch.float32)[1:]
    keep = torch.rand(1, h, 4, 4) < 0.6
    keep[..., 2, 1] = True
    mask = sv.SparseMask.from_dense(keep.to(DEVICE), n, n, 64, 64)
    _, tri = sv.block_sparse_attention(q, k, v, mask, return_tile_mass=True, backend="triton")
    _, ref = sv.block_sparse_attention(q, k, v, mask, return_tile_mass=True, backend="reference")
    assert (tri - ref).abs().max() < 2e-5


def test_tile_mass_custom_op_passes_opcheck_and_compiles():
    b, h, n, d = 1, 2, 130, 32
    mask = make_mask("random", b, h, n, n, 64, 64)
    q, k, v = rand_qkv(b, h, n, n, d, torch.float32)
    args = (q, k, v, mask.kv_count, mask.kv_index, 64, 64, d ** -0.5, mask.max_kept_blocks)
    torch.library.opcheck(torch.ops.sparsevid.block_sparse_attn_tile_mass.default, args)

    def layer(q, k, v):
        out, mass = sv.block_sparse_attention(q * 2.0, k, v, mask, return_tile_mass=True, backend="triton")
        return out.relu(), mass

    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    (out_c, mass_c), (out_e, mass_e) = compiled(q, k, v), layer(q, k, v)
    assert rel_err(out_c, out_e) < 1e-6 and rel_err(mass_c, mass_e) < 1e-6


def test_tile_mass_requests_are_checked():
    b, h, n, d = 1, 1, 128, 32
    mask = make_mask("random", b, h, n, n, 64, 64)
    q, k, v = (t.requires_grad_() for t in rand_qkv(b, h, n, n, d, torch.float32))
    for backend in ("triton", "reference"):
        with pytest.raises(ValueError, match="inference only"):
            sv.block_sparse_attention(q, k, v, mask, return_tile_mass=True, backend=backend)
    with torch.no_grad():
        with pytest.raises(ValueError, match="return_tile_mass=True needs one of the backends"):
            sv.block_sparse_attention(q, k, v, mask, return_tile_mass=True, backend="flex")
        with pytest.raises(TypeError, match="return_tile_mass must be a bool"):
            sv.block_sparse_attention(q, k, v, mask, return_tile_mass=1, backend="reference")
        out, mass = sv.block_sparse_attention(q, k, v, mask, return_tile_mass=True, backend="reference")
        assert mass.shape == (1, 1, 2, 2)


def test_triton_tile_mass_when_one_program_owns_a_whole_query_block(monkeypatch, nan_poisoned_outputs):
    """The interpreter's default config splits a 128-row block over two programs (ROWS=64); on the GPU the
    autotuner may give one program all 128 rows (and whole 64-key tiles): the masses must not change."""
    import triton

    kernel = triton_attention._bsa_fwd_kernel
    monkeypatch.setattr(kernel, "configs", [triton.Config({"ROWS": 128, "SUB_N": 64}, num_warps=4, num_stages=1,
                                                          pre_hook=kernel.configs[0].pre_hook)])
    b, h, n, m, d = 1, 2, 333, 200, 64
    mask = make_mask("random", b, h, n, m, 128, 64)
    q, k, v = rand_qkv(b, h, n, m, d, torch.float32)
    _, mass = sv.block_sparse_attention(q, k, v, mask, return_tile_mass=True, backend="triton")
    assert (mass.double() - dense_tile_mass(q, k, mask)).abs().max() < 5e-6
