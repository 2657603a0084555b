"""Video token tiling: a permutation, its inverse, compact tiles, odd grids, helpers and input checks."""
from __future__ import annotations

import pytest
import torch

import sparsevid as sv
from sparsevid.ops.tiling import DEFAULT_TILE, tile_tokens, untile_tokens

GRIDS = [
    pytest.param((3, 5, 7), (2, 2, 4), id="3x5x7-odd"),
    pytest.param((4, 16, 16), None, id="4x16x16-default"),
    pytest.param((1, 1, 9), (2, 8, 8), id="1x1x9-smaller-than-tile"),
    pytest.param((5, 30, 52), (4, 4, 8), id="5x30x52-partial-edges"),
]


def coords(grid):
    t, h, w = grid
    idx = torch.arange(t * h * w)
    return idx // (h * w), (idx // w) % h, idx % w


@pytest.mark.parametrize("grid,tile", GRIDS)
def test_permutation_and_inverse(grid, tile):
    perm, inverse = sv.tile_permutation(grid, tile)
    n = grid[0] * grid[1] * grid[2]
    assert perm.dtype == torch.int64 and perm.shape == (n,)
    assert torch.equal(torch.sort(perm).values, torch.arange(n))
    assert torch.equal(perm[inverse], torch.arange(n))
    x = torch.randn(2, n, 3)
    assert torch.equal(x[..., perm, :][..., inverse, :], x)


@pytest.mark.parametrize("grid,tile", GRIDS)
def test_consecutive_tokens_form_tiles(grid, tile):
    """Each run of tokens in tile order is one tile: a box of at most the tile's extent, visited in raster
    order, and tiles follow each other in raster order of the tile grid."""
    tt, th, tw = tile or DEFAULT_TILE
    perm, _ = sv.tile_permutation(grid, tile)
    t, y, x = (c[perm] for c in coords(grid))
    tile_id = ((t // tt) * -(-grid[1] // th) + y // th) * -(-grid[2] // tw) + x // tw
    assert bool((tile_id[1:] >= tile_id[:-1]).all())  # tiles are contiguous and in order
    for i in torch.unique(tile_id).tolist():
        sel = tile_id == i
        ts, ys, xs = t[sel], y[sel], x[sel]
        assert int(ts.max() - ts.min()) < tt and int(ys.max() - ys.min()) < th and int(xs.max() - xs.min()) < tw
        raster = (ts * grid[1] + ys) * grid[2] + xs
        assert bool((raster[1:] > raster[:-1]).all())


def test_default_tile_makes_blocks_compact():
    perm, _ = sv.tile_permutation((21, 32, 48))
    t, y, x = (c[perm] for c in coords((21, 32, 48)))
    for start in range(0, 128 * 20, 128):  # every full 128-token block is one tile
        assert (int(t[start:start + 128].unique().numel()), int(y[start:start + 128].unique().numel()),
                int(x[start:start + 128].unique().numel())) == DEFAULT_TILE


def test_helpers_on_both_layouts_and_cache():
    grid = (3, 5, 7)
    x3 = torch.randn(2, 105, 4)
    x4 = torch.randn(2, 3, 105, 8).transpose(1, 2).contiguous().transpose(1, 2)  # strided [B, H, L, D]
    perm, _ = sv.tile_permutation(grid)
    for x in (x3, x4):
        tiled = tile_tokens(x, grid)
        assert torch.equal(tiled, x[..., perm, :])
        assert torch.equal(untile_tokens(tiled, grid), x)
    assert sv.tile_permutation(grid)[0] is perm            # cached
    assert sv.tile_permutation([3, 5, 7], None, "cpu")[0] is perm


@pytest.mark.parametrize("args,error,match", [
    pytest.param(((3, 5),), TypeError, "grid", id="grid-2d"),
    pytest.param(((3, 0, 5),), ValueError, "grid", id="grid-zero"),
    pytest.param(((3, 5, 7), (2, 2)), TypeError, "tile", id="tile-2d"),
    pytest.param(((3, 5, 7), (2, 2.5, 2)), ValueError, "tile", id="tile-float"),
])
def test_bad_arguments(args, error, match):
    with pytest.raises(error, match=match):
        sv.tile_permutation(*args)


def test_helpers_reject_wrong_token_count():
    with pytest.raises(ValueError, match="T\\*H\\*W"):
        tile_tokens(torch.randn(1, 100, 4), (3, 5, 7))
    with pytest.raises(TypeError, match="x"):
        untile_tokens([1, 2, 3], (1, 1, 3))


def test_compiled_code_computes_the_permutation_in_its_graph_without_the_cache():
    """Under torch.compile the tables come from device ops in the graph: no cached lookup that the compiled code
    would skip (dynamo warns when it traces through an lru_cache), and the same tables as eager."""
    import warnings

    torch._dynamo.reset()
    compiled = torch.compile(lambda x: sv.tile_permutation((3, 5, 7), (2, 2, 4), x.device), backend="eager",
                             fullgraph=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        perm, inverse = compiled(torch.zeros(1))
    assert not [w for w in caught if "lru_cache" in str(w.message)]
    expected = sv.tile_permutation((3, 5, 7), (2, 2, 4))
    assert torch.equal(perm, expected[0]) and torch.equal(inverse, expected[1])
    torch._dynamo.reset()
