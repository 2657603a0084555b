"""``predict_mask``: decide, before attention runs, which (query-block, key-block) tiles to keep.

Q and K are mean-pooled per block, the pooled rows ``softmax(scale * q_bar k_bar^T)`` over key blocks
score each tile, and a rule picks the tiles of each row (``selection.py`` defines the rules, the options
and how ties are treated; ``pooling.py`` defines pooling and block self-similarity).

Backends: "triton" (pool, logits and select launches, CUDA; on the CPU only under ``TRITON_INTERPRET=1``),
"reference" (plain PyTorch with sort-based selection, any device), "auto" (triton on CUDA, reference
elsewhere); "torch", the reference backend's former name, still works with a FutureWarning. Both give the
same masks up to rows whose threshold falls between two scores closer than fp32 rounding.
"""
from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .budgets import resolve_budgets, reused_budgets
from .mask import SparseMask, num_blocks
from .pooling import block_similarity, pool_blocks, pooled_scores
from .selection import add_option_blocks, diagonal_blocks, resolve_similarity_threshold, threshold_keep
from .settings import PredictSettings, merge_settings, warn_if_every_tile_kept, with_settings_signature
from .validation import check_head_tensors, check_triton_inputs, resolve_auto


@dataclass(frozen=True)
class MaskStats:
    """What a predicted mask keeps.

    Attributes:
        kept_mass: float32 [B, H, QB], the pooled attention mass each query-block row keeps.
        sparsity: float, fraction of (query, key) pairs skipped over the whole mask (reads the device).
        sparsity_per_head: float64 [H], that fraction per head, averaged over the batch.
    """

    kept_mass: torch.Tensor
    mask: SparseMask = field(repr=False)

    @property
    def sparsity_per_head(self) -> torch.Tensor:
        return self.mask.sparsity_per_head.mean(dim=0)

    @property
    def sparsity(self) -> float:
        return self.mask.sparsity


def _reference_predict(q, k, *, rule, rule_topk, rule_topp, min_blocks, keep_sink, keep_diagonal,
                       similarity_threshold, block_q, block_k, scale, within) -> tuple[torch.Tensor, torch.Tensor]:
    """keep bool [B, H, QB, KB] and kept pooled mass float32 [B, H, QB], in plain PyTorch."""
    q_pooled, k_pooled = pool_blocks(q, block_q), pool_blocks(k, block_k)
    scores = torch.nan_to_num(pooled_scores(q_pooled, k_pooled, scale), nan=0.0)  # selection.py: non-finite
    # Non-candidates rank below every candidate in threshold_keep, and the final "& within" drops them.
    keep = threshold_keep(scores, rule, rule_topk, rule_topp, min_blocks, candidates=within)
    with_sim = similarity_threshold is not None
    keep = add_option_blocks(
        keep, keep_sink=keep_sink,
        diagonal=diagonal_blocks(q.shape[2], k.shape[2], block_q, block_k, q.device) if keep_diagonal else None,
        q_similarity=block_similarity(q, block_q, q_pooled) if with_sim else None,
        k_similarity=block_similarity(k, block_k, k_pooled) if with_sim else None,
        threshold=similarity_threshold,
    )
    if within is not None:
        keep &= within
    return keep, (scores * keep).sum(dim=-1)


def _within_keep(within, q, k, block_q: int, block_k: int) -> torch.Tensor | None:
    """The candidate map bool [B|1, H|1, QB, KB] (contiguous) of ``within``, after checking it fits q and k."""
    if within is None:
        return None
    if not isinstance(within, SparseMask):
        raise TypeError(f"within must be None or a sparsevid.SparseMask, got {type(within).__name__}")
    if (within.block_q, within.block_k) != (block_q, block_k):
        raise ValueError(f"within has blocks ({within.block_q}, {within.block_k}) but block_q, block_k are "
                         f"({block_q}, {block_k})")
    within.check_compatible(q.shape[0], q.shape[1], q.shape[2], k.shape[2], q.device)
    return within.keep.contiguous()


@with_settings_signature
def prediction_options(q: torch.Tensor, k: torch.Tensor, settings: PredictSettings | None = None, *,
                       within: SparseMask | None = None, **options) -> dict:
    """The checked arguments of :func:`predict_mask`, resolved as both backends take them (all but ``rule``
    and ``backend``): top-k count and top-p mass (scalars or per-head tensors, None where the rule has no
    such part), similarity threshold, option flags, blocks, scale, and ``within`` as a bool map or None.
    ``settings`` and ``options`` as in :func:`predict_mask`."""
    settings = merge_settings(settings, options, "prediction_options")
    return _resolve(q, k, settings, within, resolve_budgets)


def _resolve(q: torch.Tensor, k: torch.Tensor, settings: PredictSettings, within: SparseMask | None,
             budgets: Callable[..., tuple]) -> dict:
    """The backends' arguments, the rule's budgets from ``budgets``: ``resolve_budgets`` or ``reused_budgets``."""
    check_head_tensors(q=q, k=k)
    if settings.backend == "triton":
        check_triton_inputs(q)
    heads = q.shape[1]
    kb = num_blocks(k.shape[2], settings.block_k)
    scale = settings.scale
    rule_topk, rule_topp = budgets(settings, kb, heads, q.device)
    return dict(rule_topk=rule_topk, rule_topp=rule_topp,
                similarity_threshold=resolve_similarity_threshold(settings.similarity_threshold, heads),
                min_blocks=int(settings.min_blocks), keep_sink=settings.keep_sink,
                keep_diagonal=settings.keep_diagonal, block_q=settings.block_q, block_k=settings.block_k,
                scale=float(scale) if scale is not None else q.shape[-1] ** -0.5,
                within=_within_keep(within, q, k, settings.block_q, settings.block_k))


@torch.compiler.disable
@with_settings_signature
def predict_mask(q: torch.Tensor, k: torch.Tensor, settings: PredictSettings | None = None, *,
                 within: SparseMask | None = None, **options) -> tuple[SparseMask, MaskStats]:
    """Predict a block-sparse mask from pooled attention scores.

    Args:
        q: [B, H, N, D]; k: [B, H, M, D], same dtype and device (strided views such as a transposed
            [B, N, H, D] tensor are read without a copy by the triton backend).
        settings: a :class:`~sparsevid.ops.settings.PredictSettings` (None: the defaults).
        options: any of its fields as keyword arguments, replacing the value in ``settings``:
            rule: "topk" | "topp" | "hybrid" (union of the two), see ``sparsevid.ops.selection``.
            topk: fraction of key blocks per row in (0, 1] (rounded up), an int count, or a tensor [H]
                (floating: fractions, integer: counts). Used by "topk" and "hybrid".
            topp: cumulative pooled mass in (0, 1] per row, or a float tensor [H]. Used by "topp" and "hybrid".
            block_q, block_k: tile sizes (64 or 128).
            scale: pooled-score scale, default D ** -0.5.
            keep_sink: always keep key block 0.
            keep_diagonal: keep the key blocks overlapping each query block's token range.
            similarity_threshold: None, or a float in [-1, 1] (or float tensor [H]): a query (key) block whose
                self-similarity (``sparsevid.ops.pooling``) is below it keeps its whole row (column).
            min_blocks: every row keeps at least this many tiles (before options are added).
            backend: "auto" | "triton" | "reference" (module docstring).
        within: None, or an earlier :class:`SparseMask` for the same lengths and block sizes (reduced search):
            only its kept tiles are candidates, and the result keeps a subset of them. The pooled softmax
            still spans every key block, so ``topp`` remains a share of the whole pooled row: a row whose
            candidates hold less than ``topp`` keeps all of them, as does a row with fewer candidates than
            ``topk``. Option tiles (sink, diagonal, similarity) are also limited to the candidates.

    Returns:
        (mask, stats): a :class:`SparseMask` [B, H, QB, KB] whose kv index tables are already built on
        the triton backend, and :class:`MaskStats`. Not differentiable; runs eagerly under torch.compile.

    Settings that keep every tile whatever the scores (a sequence no longer than one key block, a top-k count
    or ``min_blocks`` of at least the number of key blocks) give a UserWarning, once per cause.
    """
    if options.get("backend") == "torch":
        warnings.warn("predict_mask(backend='torch') is deprecated: the plain-PyTorch backend is called "
                      "'reference'", FutureWarning, stacklevel=2)
        options["backend"] = "reference"
    return _predict(q, k, merge_settings(settings, options, "predict_mask"), within, resolve_budgets)


@torch.compiler.disable
def predict_reused(q: torch.Tensor, k: torch.Tensor, settings: PredictSettings,
                   within: SparseMask | None = None) -> tuple[SparseMask, MaskStats]:
    """:func:`predict_mask` of q [B, H, N, D], k [B, H, M, D] under ``settings`` used for many calls (a layer plan's):
    their per-head budgets are checked, converted and moved to q's device on the first call for each device, head
    count and key-block count only (``budgets.reused_budgets``), so that a call with per-head budgets costs the host
    what one with scalar budgets does. Same results as :func:`predict_mask`."""
    return _predict(q, k, settings, within, reused_budgets)


def _predict(q: torch.Tensor, k: torch.Tensor, settings: PredictSettings, within: SparseMask | None,
             budgets: Callable[..., tuple]) -> tuple[SparseMask, MaskStats]:
    """predict_mask's work for merged ``settings``, the rule's budgets from ``budgets`` (as in ``_resolve``)."""
    resolved = _resolve(q, k, settings, within, budgets)
    n, m = q.shape[2], k.shape[2]
    block_q, block_k = settings.block_q, settings.block_k
    if within is None:
        warn_if_every_tile_kept(settings, m, num_blocks(m, block_k), resolved["rule_topk"])
    if resolve_auto(settings.backend, q, "reference") == "triton":
        from .triton_predict import triton_predict

        keep, count, index, kept_mass = triton_predict(q, k, **resolved)
        mask = SparseMask.from_dense(keep, n, m, block_q, block_k, kv_table=(count, index))
    else:
        keep, kept_mass = _reference_predict(q, k, rule=settings.rule, **resolved)
        mask = SparseMask.from_dense(keep, n, m, block_q, block_k)
    return mask, MaskStats(kept_mass=kept_mass, mask=mask)
