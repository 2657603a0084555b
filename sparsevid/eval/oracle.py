"""Oracle recall: the attention mass that the exact best tiles of each row hold, the ceiling of any mask predictor.

For one attention call q, k, v [B, H, N, D], the exact softmax mass of every (query block, key block) tile comes
from ``block_sparse_attention(..., SparseMask.full(...), return_tile_mass=True)`` (the Triton kernel on CUDA,
the chunked reference elsewhere: neither builds an N x N score matrix). Keeping the ``c`` heaviest tiles of
each query-block row is the best any mask with ``c`` tiles in that row can do, so:

* the **oracle recall** at sparsity x keeps the top ``ceil((1 - x) KB)`` tiles of every row (the count the
  top-k rule keeps for ``topk = 1 - x``) and reports the mass they hold, averaged over query rows, and the
  **oracle output error**, the relative L1 of the attention output with only those tiles kept;
* a predicted mask's recall sits beside the oracle recall at the *same per-row tile counts* (its ceiling: for
  every row, predicted <= oracle).

:class:`OracleStudy` gathers these per layer and denoising step, from recorded q, k, v or from a model's
dense forward passes (recorded by the caller), in the 3D-tiled token order that the sparse processors use.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import torch

from ..ops import DEFAULT_BLOCK_K, DEFAULT_BLOCK_Q, SparseMask, block_sparse_attention, predict_mask
from .metrics import relative_l1

ORACLE_SPARSITIES = (0.5, 0.75, 0.9, 0.95, 0.97)


def _check_sparsities(sparsities: Sequence[float]) -> tuple[float, ...]:
    if not sparsities or not all(isinstance(x, (int, float)) and not isinstance(x, bool) and 0 <= x < 1
                                 for x in sparsities):
        raise ValueError(f"sparsities must be a non-empty list of numbers in [0, 1), got {sparsities!r}")
    return tuple(float(x) for x in sparsities)


def tiles_for_sparsity(sparsity: float, num_kv_blocks: int) -> int:
    """Tiles per row kept at ``sparsity``: ``ceil((1 - sparsity) KB)``, at least 1 (as top-k with topk = 1 - x)."""
    return min(num_kv_blocks, max(1, math.ceil((1.0 - sparsity) * num_kv_blocks - 1e-6)))


@dataclass
class ExactTiles:
    """Exact tile masses of one attention call and its dense output.

    mass: float32 [B, H, QB, KB], the mean over query block i's rows of the probability they give key block j
    (each row of tiles sums to 1); out: the attention output with every tile kept, [B, H, N, D]; lse: its row
    log-sum-exps, float32 [B, H, N].
    """

    mass: torch.Tensor
    out: torch.Tensor
    q_len: int
    kv_len: int
    block_q: int
    block_k: int
    lse: torch.Tensor | None = None

    @classmethod
    @torch.no_grad()
    def measure(cls, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_q: int = DEFAULT_BLOCK_Q,
                block_k: int = DEFAULT_BLOCK_K,
                scale: float | None = None, backend: str = "auto") -> "ExactTiles":
        """Run ``block_sparse_attention`` with a full mask on q [B, H, N, D], k, v [B, H, M, D]."""
        full = SparseMask.full(q.shape[2], k.shape[2], block_q, block_k, device=q.device)
        out, lse, mass = block_sparse_attention(q, k, v, full, scale=scale, backend=backend, return_lse=True,
                                                return_tile_mass=True)
        return cls(mass, out, q.shape[2], k.shape[2], block_q, block_k, lse)

    def _row_weights(self) -> torch.Tensor:
        """float64 [QB]: the share of the N query rows in each query block (the last one may be short)."""
        rows = torch.full((self.mass.shape[2],), float(self.block_q), dtype=torch.float64, device=self.mass.device)
        rows[-1] = self.q_len - (rows.numel() - 1) * self.block_q
        return rows / self.q_len

    def recall(self, keep: torch.Tensor) -> float:
        """Mean over batch, heads and query rows of the exact mass that the tiles of ``keep`` hold.

        keep: bool [B|1, H|1, QB, KB]."""
        kept = (self.mass.double() * keep).sum(dim=-1)  # [B, H, QB]
        return float((kept * self._row_weights()).sum(dim=-1).mean())

    def top_tiles(self, per_row) -> torch.Tensor:
        """bool [B, H, QB, KB]: the ``per_row`` heaviest tiles of every row (an int, or an integer tensor
        broadcastable to [B, H, QB])."""
        rank = torch.empty_like(self.mass, dtype=torch.long)
        order = self.mass.argsort(dim=-1, descending=True, stable=True)
        rank.scatter_(-1, order, torch.arange(self.mass.shape[-1], device=self.mass.device).expand_as(order))
        per_row = torch.as_tensor(per_row, device=self.mass.device)
        return rank < per_row.unsqueeze(-1) if per_row.dim() else rank < per_row

    def mask(self, keep: torch.Tensor) -> SparseMask:
        return SparseMask.from_dense(keep, self.q_len, self.kv_len, self.block_q, self.block_k)

    @torch.no_grad()
    def output_error(self, q, k, v, keep: torch.Tensor, scale: float | None = None, backend: str = "auto") -> float:
        """Relative L1 of the attention output with only the tiles of ``keep`` kept, against :attr:`out`."""
        return relative_l1(block_sparse_attention(q, k, v, self.mask(keep), scale=scale, backend=backend), self.out)


@torch.no_grad()
def oracle_recall(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sparsities: Sequence[float] = ORACLE_SPARSITIES,
                  block_q: int = DEFAULT_BLOCK_Q, block_k: int = DEFAULT_BLOCK_K, scale: float | None = None,
                  backend: str = "auto",
                  masks: dict[str, SparseMask] | None = None) -> dict:
    """Oracle recall and output error of one attention call, and predicted masks beside them.

    q: [B, H, N, D]; k, v: [B, H, M, D], in the token order the masks refer to. masks: {name: SparseMask} over
    the same (block_q, block_k) tiles (e.g. from ``sparsevid.predict_mask``).
    Returns {"sparsity": the targets, "achieved_sparsity", "recall", "output_rel_l1": one float per target,
    "predicted": {name: {"sparsity", "recall", "oracle_recall"}}} where "oracle_recall" keeps, in every row,
    as many of the heaviest tiles as the predicted mask keeps there.
    """
    tiles = ExactTiles.measure(q, k, v, block_q, block_k, scale, backend)
    result = oracle_curve(tiles, q, k, v, _check_sparsities(sparsities), scale, backend)
    result["predicted"] = {name: predicted_recall(tiles, mask) for name, mask in (masks or {}).items()}
    return result


def oracle_curve(tiles: ExactTiles, q, k, v, sparsities: Sequence[float], scale: float | None = None,
                 backend: str = "auto") -> dict:
    """{"sparsity", "achieved_sparsity", "recall", "output_rel_l1"}: the heaviest tiles of every row at each
    target sparsity, from the exact ``tiles`` of the call q, k, v."""
    result = {"sparsity": list(sparsities), "achieved_sparsity": [], "recall": [], "output_rel_l1": []}
    for x in sparsities:
        keep = tiles.top_tiles(tiles_for_sparsity(x, tiles.mass.shape[-1]))
        result["achieved_sparsity"].append(tiles.mask(keep).sparsity)
        result["recall"].append(tiles.recall(keep))
        result["output_rel_l1"].append(tiles.output_error(q, k, v, keep, scale, backend))
    return result


def predicted_recall(tiles: ExactTiles, mask: SparseMask) -> dict:
    """{"sparsity", "recall", "oracle_recall"} of ``mask`` (made for the tiles of ``tiles``): its achieved
    sparsity, the exact mass it keeps, and the mass of the heaviest tiles at its per-row counts."""
    if (mask.q_len, mask.kv_len, mask.block_q, mask.block_k) != (tiles.q_len, tiles.kv_len, tiles.block_q,
                                                                   tiles.block_k):
        raise ValueError(f"mask covers ({mask.q_len}, {mask.kv_len}) tokens in {mask.block_q}x{mask.block_k} tiles, "
                         f"the tile masses ({tiles.q_len}, {tiles.kv_len}) in {tiles.block_q}x{tiles.block_k}")
    keep = mask.keep.to(tiles.mass.device)
    return {"sparsity": mask.sparsity, "recall": tiles.recall(keep),
            "oracle_recall": tiles.recall(tiles.top_tiles(keep.sum(dim=-1)))}


@dataclass
class OracleStudy:
    """Oracle and predicted recall per layer and denoising step over many attention calls.

    sparsities: the oracle's sparsity grid; configs: {name: SparseConfig} whose masks are predicted afresh for
    every call (``config.plan(layer, step, timestep)``, None = dense: recall 1) in that plan's token order and
    tiles. ``grid``: the (T, H, W) token grid of raster-order inputs (q, k, v are reordered to each 3D tile);
    None means the inputs are already in the order wanted (oracle and every plan then use it as is).
    tile: the oracle's tile order ("auto": the sparse processors' default), block_q / block_k its tiles.
    """

    sparsities: Sequence[float] = ORACLE_SPARSITIES
    configs: dict = field(default_factory=dict)
    grid: tuple[int, int, int] | None = None
    tile: str | tuple[int, int, int] = "auto"
    block_q: int = DEFAULT_BLOCK_Q
    block_k: int = DEFAULT_BLOCK_K
    backend: str = "auto"
    calls: dict = field(default_factory=dict)  # (layer, step) -> list of per-call results

    def __post_init__(self):
        self.sparsities = _check_sparsities(self.sparsities)

    def _ordered(self, tensors, tile):
        if self.grid is None or tile == "none":
            return tensors
        from ..integration.token_order import tile_order

        perm = tile_order(self.grid, tile, tensors[0].device).perm
        return tuple(t.index_select(2, perm) for t in tensors)

    @torch.no_grad()
    def add(self, layer: int, step: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            scale: float | None = None, timestep: float | None = None) -> None:
        """Measure one video self-attention call q, k, v [B, H, N, D] of ``layer`` at denoising ``step``."""
        measured: dict = {}  # (tile, block_q, block_k) -> (q, k, v in that order, their ExactTiles)

        def tiles_for(tile, block_q, block_k):
            if (tile, block_q, block_k) not in measured:
                ordered = self._ordered((q, k, v), tile)
                measured[tile, block_q, block_k] = ordered, ExactTiles.measure(*ordered, block_q, block_k, scale,
                                                                               self.backend)
            return measured[tile, block_q, block_k]

        ordered, tiles = tiles_for(self.tile, self.block_q, self.block_k)
        result = oracle_curve(tiles, *ordered, self.sparsities, scale, self.backend)
        result["predicted"] = {}
        for name, config in self.configs.items():
            plan = config.plan(layer, step, timestep)
            if plan is None:
                result["predicted"][name] = {"sparsity": 0.0, "recall": 1.0, "oracle_recall": 1.0}
                continue
            (q_o, k_o, _), plan_tiles = tiles_for(plan.tile, plan.block_q, plan.block_k)
            mask, _ = predict_mask(q_o, k_o, scale=scale, backend=plan.predict_backend, **plan.predict_kwargs())
            result["predicted"][name] = predicted_recall(plan_tiles, mask)
        self.calls.setdefault((layer, step), []).append(result)

    def summary(self) -> dict:
        """Means over the calls of each (layer, step), as nested lists: "oracle" {"recall", "output_rel_l1":
        [layer][step][sparsity], "achieved_sparsity": [sparsity], and means over layers and steps ("recall_mean",
        "output_rel_l1_mean": [sparsity]) and over steps ("recall_per_layer": [layer][sparsity])}; "predicted"
        {name: {"sparsity", "recall", "oracle_recall": [layer][step], their overall means "..._mean" and
        "recall_per_layer" / "oracle_recall_per_layer": [layer]}}."""
        if not self.calls:
            raise ValueError("no attention call was measured")
        layers = sorted({layer for layer, _ in self.calls})
        steps = sorted({step for _, step in self.calls})
        mean = lambda xs: sum(xs) / len(xs)  # noqa: E731

        def table(get):  # [layer][step] of the mean over that cell's calls (None where a cell has none)
            return [[mean([get(c) for c in self.calls[(la, s)]]) if (la, s) in self.calls else None for s in steps]
                    for la in layers]

        def overall(cells):
            return mean([x for row in cells for x in row if x is not None])

        def per_layer(cells):
            return [mean([x for x in row if x is not None]) for row in cells]

        grid = range(len(self.sparsities))
        recall = [table(lambda c, i=i: c["recall"][i]) for i in grid]  # [sparsity][layer][step]
        error = [table(lambda c, i=i: c["output_rel_l1"][i]) for i in grid]
        every = [c for cs in self.calls.values() for c in cs]
        out = {"sparsities": list(self.sparsities), "layers": layers, "steps": steps, "oracle": {
            "recall": [[[recall[i][la][s] for i in grid] for s in range(len(steps))] for la in range(len(layers))],
            "output_rel_l1": [[[error[i][la][s] for i in grid] for s in range(len(steps))]
                              for la in range(len(layers))],
            "achieved_sparsity": [mean([c["achieved_sparsity"][i] for c in every]) for i in grid],
            "recall_mean": [overall(recall[i]) for i in grid],
            "output_rel_l1_mean": [overall(error[i]) for i in grid],
            "recall_per_layer": [list(row) for row in zip(*(per_layer(recall[i]) for i in grid))]},
            "predicted": {}}
        for name in self.configs:
            entry = {}
            for key in ("sparsity", "recall", "oracle_recall"):
                cells = table(lambda c, key=key: c["predicted"][name][key])
                entry.update({key: cells, f"{key}_mean": overall(cells)})
                if key != "sparsity":
                    entry[f"{key}_per_layer"] = per_layer(cells)
            out["predicted"][name] = entry
        return out
