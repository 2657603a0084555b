"""Video token tiling: reorder a raster (T, H, W) token grid so that consecutive tokens form 3D tiles.

In raster order a 128-token block is a thin strip of one frame; in tile order it is a compact space-time
patch, whose mean pools far more faithfully (see ``benchmarks/bench_predict.py`` for the measured recall).
Tiles are visited in raster order of the tile grid and tokens inside a tile in raster order; tiles at the
grid's far edges are cut short when a grid side is not a multiple of the tile side.

    perm, inverse = tile_permutation((T, H, W))
    x_tiled = x[..., perm, :]          # [..., T*H*W, C] raster -> tiled
    x = x_tiled[..., inverse, :]       # and back
"""
from __future__ import annotations

import numbers

import torch

from .caching import traceable_cache

# Default tile (frames, rows, columns): 128 tokens, so with block_q = 128 every full query block is one
# 4x4x8 patch and every 64-token key block a 2x4x8 patch. Chosen for the best attention recall at 95%
# sparsity among the tiles compared by benchmarks/bench_predict.py (figures in benchmarks/NOTES.md).
DEFAULT_TILE = (4, 4, 8)


def _as_triple(name: str, value) -> tuple[int, int, int]:
    if not isinstance(value, (tuple, list)) or len(value) != 3:
        raise TypeError(f"{name} must be a (t, h, w) tuple of 3 ints, got {value!r}")
    if not all(isinstance(v, numbers.Integral) and not isinstance(v, bool) and v >= 1 for v in value):
        raise ValueError(f"{name} must hold 3 ints >= 1, got {value!r}")
    return tuple(int(v) for v in value)


@traceable_cache()
def _permutation(grid: tuple[int, int, int], tile: tuple[int, int, int],
                       device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """perm, inverse int64 [T*H*W], computed on ``device`` (no host-to-device copy) by a handful of kernels."""
    (t, h, w), (tt, th, tw) = grid, tile
    ti = torch.arange(t, device=device).view(t, 1, 1)
    yi = torch.arange(h, device=device).view(1, h, 1)
    xi = torch.arange(w, device=device).view(1, 1, w)
    tiles_h, tiles_w = -(-h // th), -(-w // tw)
    tile_id = ((ti // tt) * tiles_h + yi // th) * tiles_w + xi // tw
    within = ((ti % tt) * th + yi % th) * tw + xi % tw
    perm = torch.argsort((tile_id * (tt * th * tw) + within).flatten())  # keys are distinct: one order
    inverse = torch.empty_like(perm).scatter_(0, perm, torch.arange(perm.numel(), device=device))
    return perm, inverse


def tile_permutation(grid, tile=None, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Token permutation from raster order of a (T, H, W) grid to 3D-tile order, and its inverse.

    Args:
        grid: (T, H, W) token grid, ints >= 1.
        tile: (t, h, w) tile shape, default ``DEFAULT_TILE``.
        device: where the returned tensors live (default CPU).

    Returns:
        perm, inverse: int64 [T*H*W]; ``x[..., perm, :]`` is x in tile order and ``y[..., inverse, :]``
        undoes it. Cached per (grid, tile, device): treat them as read-only. While ``torch.compile`` traces,
        they are computed in the graph instead (a few small kernels; no cache lookup that the compiled code
        would skip, and nothing on the host, so CUDA graphs can capture it).
    """
    grid = _as_triple("grid", grid)
    tile = DEFAULT_TILE if tile is None else _as_triple("tile", tile)
    return _permutation(grid, tile, torch.device(device) if device is not None else torch.device("cpu"))


def _reorder(x: torch.Tensor, grid, tile, inverse: bool) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    perm, undo = tile_permutation(grid, tile, x.device)
    if x.dim() < 2 or x.shape[-2] != perm.numel():
        raise ValueError(f"x must have its {perm.numel()} = T*H*W tokens in dim -2 ([B, L, C] or [B, H, L, D]), "
                         f"got shape {tuple(x.shape)}")
    return x.index_select(-2, undo if inverse else perm)


def tile_tokens(x: torch.Tensor, grid, tile=None) -> torch.Tensor:
    """x [..., T*H*W, C] in raster order -> the same tokens in 3D-tile order (a new tensor)."""
    return _reorder(x, grid, tile, inverse=False)


def untile_tokens(x: torch.Tensor, grid, tile=None) -> torch.Tensor:
    """x [..., T*H*W, C] in 3D-tile order -> raster order (inverse of :func:`tile_tokens`)."""
    return _reorder(x, grid, tile, inverse=True)
