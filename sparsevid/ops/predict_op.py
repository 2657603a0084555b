"""Mask prediction as custom ops (``torch.ops.sparsevid.predict_mask`` and ``predict_mask_per_head``), so that
``torch.compile`` traces it.

:func:`predict_mask_traced` is what code inside a compiled model calls: while ``torch.compile`` traces, an op with
its fake (output shapes from the input shapes and block sizes) stands in, so the prediction neither breaks the graph
nor reads the device. ``predict_mask`` takes the settings' fields as numbers; ``predict_mask_per_head`` takes a
layer plan's per-head budget tensors [H] themselves (inputs of the graph: the same objects on every call) and the
slice of heads the call holds. Both make the settings of a call once per distinct arguments (tensors told apart by
identity), and :func:`~sparsevid.ops.predict.predict_reused` resolves and moves their budgets to the device once,
so that a call with per-head budgets does the host work of one with scalar budgets.

The per-head op keeps those budgets on the device between calls, memory that a CUDA graph's private pool must not
hold: it is tagged ``cudagraph_unsafe`` (where torch has the tag), so that inductor leaves it out of CUDA graphs
(``mode="reduce-overhead"``: a graph partition of its own, or no CUDA graph; older torch skips CUDA graphs for its
host tensor inputs anyway).
"""
from __future__ import annotations

import torch

from .budgets import ByIdentity, has_head_budgets, head_slice
from .mask import SparseMask, num_blocks
from .predict import predict_reused
from .settings import PredictSettings

# PredictSettings fields besides the rule and its budgets, in the ops' argument order.
_FIELDS = ("block_q", "block_k", "scale", "keep_sink", "keep_diagonal", "similarity_threshold", "min_blocks", "backend")
_CUDAGRAPH_UNSAFE = {"tags": (torch.Tag.cudagraph_unsafe,)} if hasattr(torch.Tag, "cudagraph_unsafe") else {}
_SETTINGS = ByIdentity()


def _settings(rule: str, topk, topp, fields: tuple) -> PredictSettings:
    return PredictSettings(rule=rule, topk=topk, topp=topp, **dict(zip(_FIELDS, fields)))


def _predict(q: torch.Tensor, k: torch.Tensor, settings: PredictSettings) -> tuple[torch.Tensor, ...]:
    mask, stats = predict_reused(q, k, settings)
    return mask.keep, mask.kv_count, mask.kv_index, stats.kept_mass  # four tensors, none sharing memory


# The ops' schemas need typed arguments: the PredictSettings fields, with a scalar topk as a float and a flag saying
# whether it is a count (predict_mask_traced packs them; the settings are checked when first made).
@torch.library.custom_op("sparsevid::predict_mask", mutates_args=())
def _predict_mask_op(q: torch.Tensor, k: torch.Tensor, rule: str, topk: float, topk_is_count: bool, topp: float,
                     block_q: int, block_k: int, scale: float | None, keep_sink: bool, keep_diagonal: bool,
                     similarity_threshold: float | None, min_blocks: int,
                     backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    fields = (block_q, block_k, scale, keep_sink, keep_diagonal, similarity_threshold, min_blocks, backend)
    settings = _SETTINGS.get((), (rule, topk, topk_is_count, topp, *fields), lambda: _settings(
        rule, int(topk) if topk_is_count else topk, topp, fields))
    return _predict(q, k, settings)


@torch.library.custom_op("sparsevid::predict_mask_per_head", mutates_args=(), **_CUDAGRAPH_UNSAFE)
def _predict_per_head_op(q: torch.Tensor, k: torch.Tensor, topk: torch.Tensor, topp: torch.Tensor, head_start: int,
                         head_stop: int, rule: str, block_q: int, block_k: int, scale: float | None, keep_sink: bool,
                         keep_diagonal: bool, similarity_threshold: float | None, min_blocks: int,
                         backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    heads = range(head_start, head_stop)
    fields = (block_q, block_k, scale, keep_sink, keep_diagonal, similarity_threshold, min_blocks, backend)
    settings = _SETTINGS.get((topk, topp), (heads, rule, *fields),
                             lambda: head_slice(_settings(rule, topk, topp, fields), heads))
    return _predict(q, k, settings)


def fake_mask_outputs(q: torch.Tensor, k: torch.Tensor, block_q: int, block_k: int) -> tuple[torch.Tensor, ...]:
    """Empty tensors shaped as a prediction op's outputs for q [B, H, N, D], k [B, H, M, D]: keep bool
    [B, H, QB, KB], kv_count int32 [B, H, QB], kv_index int32 [B, H, QB, KB], kept mass float32 [B, H, QB]."""
    batch, heads = q.shape[:2]
    qb, kb = num_blocks(q.shape[2], block_q), num_blocks(k.shape[2], block_k)
    return (q.new_empty((batch, heads, qb, kb), dtype=torch.bool),
            q.new_empty((batch, heads, qb), dtype=torch.int32),
            q.new_empty((batch, heads, qb, kb), dtype=torch.int32),
            q.new_empty((batch, heads, qb), dtype=torch.float32))


@_predict_mask_op.register_fake
def _(q, k, rule, topk, topk_is_count, topp, block_q, block_k, *fields):
    return fake_mask_outputs(q, k, block_q, block_k)


@_predict_per_head_op.register_fake
def _(q, k, topk, topp, head_start, head_stop, rule, block_q, block_k, *fields):
    return fake_mask_outputs(q, k, block_q, block_k)


def predict_mask_traced(q: torch.Tensor, k: torch.Tensor, settings: PredictSettings, scale: float | None = None,
                        heads: range | None = None) -> tuple[SparseMask, torch.Tensor]:
    """``predict_mask`` of q [B, H', N, D], k [B, H', M, D] under ``settings`` (its ``scale`` replaced by ``scale``)
    as a prediction op, traceable by torch.compile (no ``within``). Per-head budgets are those of the global
    ``heads`` the call holds (None: all, H' = H) of the settings' tensors [H] (a layer plan's: ``topk`` and
    ``topp`` both tensors). Returns the mask (with its kv index tables) and the pooled mass each query-block row
    keeps, float32 [B, H', QB]: the results of ``predict_mask``."""
    threshold = settings.similarity_threshold
    if isinstance(threshold, torch.Tensor):
        raise TypeError("predict_mask_traced takes a scalar similarity_threshold (per-head values need predict_mask)")
    fields = (settings.block_q, settings.block_k, None if scale is None else float(scale), settings.keep_sink,
              settings.keep_diagonal, None if threshold is None else float(threshold), settings.min_blocks,
              settings.backend)
    if has_head_budgets(settings):
        heads = range(settings.topk.shape[0]) if heads is None else heads
        outputs = _predict_per_head_op(q, k, settings.topk, settings.topp, heads.start, heads.stop, settings.rule,
                                       *fields)
    else:
        topk = settings.topk
        outputs = _predict_mask_op(q, k, settings.rule, float(topk), isinstance(topk, int), float(settings.topp),
                                   *fields)
    keep, count, index, kept_mass = outputs
    mask = SparseMask.from_dense(keep, q.shape[2], k.shape[2], settings.block_q, settings.block_k,
                                 kv_table=(count, index))
    return mask, kept_mass
