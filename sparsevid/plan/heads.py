"""Per-head budgets in mask prediction: a plan whose ``topk`` / ``topp`` give one value per head.

A plan's per-head budgets are CPU tensors [H] (``LayerPlan.predict_settings``); a call sees H' <= H heads (all of
them, or under Ulysses context parallelism the slice ``heads`` of its rank) and predicts with that slice
(``sparsevid.plan.reuse.predict_plan_mask``). Under torch.compile the prediction is the custom op
``sparsevid::predict_mask_per_head`` (:func:`predict_heads_traced`), whose budgets are tensor arguments (the
scalar op, ``torch.ops.sparsevid.predict_mask``, takes numbers only).
"""
from __future__ import annotations

import torch

from ..ops import PredictSettings, SparseMask, predict_mask
from ..ops.predict_op import fake_mask_outputs


def has_head_budgets(settings: PredictSettings) -> bool:
    """Whether ``settings`` hold a per-head ``topk`` or ``topp`` (a tensor [H])."""
    return isinstance(settings.topk, torch.Tensor) or isinstance(settings.topp, torch.Tensor)


def head_slice(settings: PredictSettings, heads: range | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk, topp): the per-head budgets [H] of ``settings`` (both tensors, as ``LayerPlan`` makes them) for the
    global ``heads`` a call holds (None: all), as [H'] tensors."""
    budgets = settings.topk, settings.topp
    if heads is None:
        return budgets
    if heads.stop > budgets[0].numel():
        raise ValueError(f"the plan gives {budgets[0].numel()} per-head budgets, but the call holds heads "
                         f"{heads.start}..{heads.stop - 1}")
    return tuple(value[heads.start:heads.stop] for value in budgets)


@torch.library.custom_op("sparsevid::predict_mask_per_head", mutates_args=())
def _predict_per_head_op(q: torch.Tensor, k: torch.Tensor, topk: torch.Tensor, topp: torch.Tensor, rule: str,
                         block_q: int, block_k: int, scale: float, keep_sink: bool, keep_diagonal: bool,
                         similarity_threshold: float | None, min_blocks: int,
                         backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    settings = PredictSettings(rule=rule, topk=topk, topp=topp, block_q=block_q, block_k=block_k, scale=scale,
                               keep_sink=keep_sink, keep_diagonal=keep_diagonal,
                               similarity_threshold=similarity_threshold, min_blocks=min_blocks, backend=backend)
    mask, stats = predict_mask(q, k, settings)
    # The Triton predictor's counts and indices are views of one buffer; a custom op's outputs may not alias.
    return mask.keep, mask.kv_count.clone(), mask.kv_index, stats.kept_mass


@_predict_per_head_op.register_fake
def _(q, k, topk, topp, rule, block_q, block_k, scale, keep_sink, keep_diagonal, similarity_threshold, min_blocks,
      backend):
    return fake_mask_outputs(q, k, block_q, block_k)


def predict_heads_traced(q: torch.Tensor, k: torch.Tensor, settings: PredictSettings, scale: float | None,
                         heads: range | None = None) -> tuple[SparseMask, torch.Tensor]:
    """While torch.compile traces: the mask of q [B, H', N, D], k [B, H', M, D] under ``settings`` with per-head
    budgets, of which the call holds the global ``heads`` (None: all, H' = H), and the pooled mass each
    query-block row keeps, float32 [B, H', QB], as the custom op ``sparsevid::predict_mask_per_head``."""
    topk, topp = head_slice(settings, heads)
    threshold = settings.similarity_threshold
    keep, count, index, kept_mass = _predict_per_head_op(
        q, k, topk, topp, settings.rule, settings.block_q, settings.block_k,
        q.shape[-1] ** -0.5 if scale is None else float(scale), settings.keep_sink, settings.keep_diagonal,
        None if threshold is None else float(threshold), settings.min_blocks, settings.backend)
    mask = SparseMask.from_dense(keep, q.shape[2], k.shape[2], settings.block_q, settings.block_k,
                                 kv_table=(count, index))
    return mask, kept_mass
