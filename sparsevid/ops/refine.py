"""``select_from_mass``: refine a mask from the exact tile masses its attention produced.

``block_sparse_attention(..., return_tile_mass=True)`` gives, for every kept tile, the exact softmax mass
its query rows gave it (normalised over the mask's kept tiles). Running a selection rule of
``selection.py`` on those masses instead of pooled scores keeps the tiles that really carried the attention;
the result is always a subset of the mask the masses were measured under.
"""
from __future__ import annotations

import torch

from .mask import SparseMask
from .predict import MaskStats
from .selection import add_option_blocks, diagonal_blocks, resolve_topk, resolve_topp, threshold_keep
from .settings import PredictSettings, merge_settings, with_settings_signature

# The PredictSettings fields select_from_mass reads (the mask fixes the blocks; there are no tokens to pool).
SELECT_FIELDS = ("rule", "topk", "topp", "min_blocks", "keep_sink", "keep_diagonal")


def _check(tile_mass, mask, row_share) -> None:
    if not isinstance(mask, SparseMask):
        raise TypeError(f"mask must be a sparsevid.SparseMask, got {type(mask).__name__}")
    if not isinstance(tile_mass, torch.Tensor) or not tile_mass.is_floating_point():
        raise TypeError(f"tile_mass must be a floating-point tensor, got {type(tile_mass).__name__}")
    if tile_mass.dim() != 4 or tuple(tile_mass.shape[-2:]) != tuple(mask.keep.shape[-2:]):
        raise ValueError(f"tile_mass must have shape [B, H, {mask.num_q_blocks}, {mask.num_kv_blocks}] to match "
                         f"the mask, got {tuple(tile_mass.shape)}")
    mask.check_compatible(tile_mass.shape[0], tile_mass.shape[1], mask.q_len, mask.kv_len, tile_mass.device)
    if row_share is not None:
        if not isinstance(row_share, torch.Tensor) or not row_share.is_floating_point():
            raise TypeError(f"row_share must be None or a float tensor [B, H, QB], got {type(row_share).__name__}")
        try:
            torch.broadcast_shapes(row_share.shape, tile_mass.shape[:-1])
        except RuntimeError:
            raise ValueError(f"row_share must broadcast to {tuple(tile_mass.shape[:-1])}, "
                             f"got {tuple(row_share.shape)}") from None


@torch.compiler.disable
@with_settings_signature
def select_from_mass(tile_mass: torch.Tensor, mask: SparseMask, settings: PredictSettings | None = None, *,
                     row_share: torch.Tensor | None = None, **options) -> tuple[SparseMask, MaskStats]:
    """A subset of ``mask`` chosen by a selection rule over exact tile masses.

    Args:
        tile_mass: float [B, H, QB, KB], the masses ``block_sparse_attention(..., mask, return_tile_mass=True)``
            returned (each row-block sums to 1 over the mask's kept tiles).
        mask: the mask they were measured under; its kept tiles are the only candidates.
        settings, options: a :class:`~sparsevid.ops.settings.PredictSettings` and/or its fields as keyword
            arguments, as in :func:`sparsevid.predict_mask`. Of them, ``rule``, ``topk`` (a fraction of all KB
            key blocks or a count), ``topp`` (a share of the attention row), ``min_blocks``, ``keep_sink`` and
            ``keep_diagonal`` apply (``SELECT_FIELDS``); the blocks are the mask's, and the similarity
            threshold, scale and backend do not apply.
        row_share: None or float [B|1, H|1, QB]: the share of the full (dense) attention row that ``mask``
            holds, e.g. the ``kept_mass`` of the prediction that made it. The masses are scaled by it, so
            ``topp`` stays a share of the full row rather than of the mask: a row whose candidates hold less
            than ``topp`` keeps all of them. None means 1.

    Returns:
        (new_mask, stats): new_mask [B, H, QB, KB] with ``new_mask.keep <= mask.keep``; ``stats.kept_mass``
        float32 [B, H, QB] is the share of the full row the new mask holds (``row_share`` times its exact mass).
    """
    settings = merge_settings(settings, options, "select_from_mass")
    _check(tile_mass, mask, row_share)
    heads = tile_mass.shape[1]
    scores = tile_mass.float()
    if row_share is not None:
        scores = scores * row_share.float().unsqueeze(-1)
    rule_topk = resolve_topk(settings.topk, mask.num_kv_blocks, heads) if settings.uses_topk else None
    rule_topp = resolve_topp(settings.topp, heads) if settings.uses_topp else None
    # Skipped tiles hold no mass and are never kept.
    keep = threshold_keep(scores, settings.rule, rule_topk, rule_topp, settings.min_blocks, candidates=mask.keep)
    diagonal = (diagonal_blocks(mask.q_len, mask.kv_len, mask.block_q, mask.block_k, scores.device)
                if settings.keep_diagonal else None)
    keep = add_option_blocks(keep, keep_sink=settings.keep_sink, diagonal=diagonal, q_similarity=None,
                             k_similarity=None, threshold=None)
    keep &= mask.keep
    new_mask = SparseMask.from_dense(keep, mask.q_len, mask.kv_len, mask.block_q, mask.block_k)
    return new_mask, MaskStats(kept_mass=(scores * keep).sum(dim=-1), mask=new_mask)
