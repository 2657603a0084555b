"""Mask prediction as a custom op (``torch.ops.sparsevid.predict_mask``), so that ``torch.compile`` traces it.

:func:`predict_mask_traced` is what code inside a compiled model calls: eagerly it is
:func:`~sparsevid.ops.predict.predict_mask` itself (no custom-op dispatch on the host); while ``torch.compile``
traces, the op with its fake (output shapes from the input shapes and block sizes) stands in, so the
prediction neither breaks the graph nor reads the device. The op takes scalar budgets (no per-head tensors,
no ``within``): what a layer's plan holds.
"""
from __future__ import annotations

import torch

from .mask import SparseMask, num_blocks
from .predict import predict_mask
from .settings import DEFAULTS, FIELDS, PredictSettings, with_settings_signature


# The op's schema needs typed scalar arguments: the PredictSettings fields, with topk as a float and a flag
# saying whether it is a count (_op_arguments packs them; the op checks them as PredictSettings).
@torch.library.custom_op("sparsevid::predict_mask", mutates_args=())
def _predict_mask_op(q: torch.Tensor, k: torch.Tensor, rule: str, topk: float, topk_is_count: bool, topp: float,
                     block_q: int, block_k: int, scale: float | None, keep_sink: bool, keep_diagonal: bool,
                     similarity_threshold: float | None, min_blocks: int,
                     backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    settings = PredictSettings(rule=rule, topk=int(topk) if topk_is_count else topk, topp=topp, block_q=block_q,
                               block_k=block_k, scale=scale, keep_sink=keep_sink, keep_diagonal=keep_diagonal,
                               similarity_threshold=similarity_threshold, min_blocks=min_blocks, backend=backend)
    mask, stats = predict_mask(q, k, settings)
    return _unaliased((mask.keep, mask.kv_count, mask.kv_index, stats.kept_mass))


def _op_arguments(settings: PredictSettings | None, options: dict) -> tuple:
    """The scalar arguments of ``_predict_mask_op`` after q and k: ``settings`` with ``options`` replacing its
    fields, read without building a new settings object (this runs while torch.compile traces)."""
    settings = DEFAULTS if settings is None else settings
    unknown = sorted(set(options) - set(FIELDS))
    if unknown:
        raise TypeError(f"predict_mask_traced() got unexpected keyword argument(s) {unknown}; the settings are "
                        f"{FIELDS}")
    value = {name: options[name] if name in options else getattr(settings, name) for name in FIELDS}
    if any(isinstance(value[name], torch.Tensor) for name in ("topk", "topp", "similarity_threshold")):
        raise TypeError("predict_mask_traced takes scalar topk, topp and similarity_threshold (per-head values "
                        "need predict_mask)")
    topk, scale, threshold = value["topk"], value["scale"], value["similarity_threshold"]
    topk_is_count = isinstance(topk, int) and not isinstance(topk, bool)
    return (value["rule"], float(topk), topk_is_count, float(value["topp"]), value["block_q"], value["block_k"],
            None if scale is None else float(scale), value["keep_sink"], value["keep_diagonal"],
            None if threshold is None else float(threshold), value["min_blocks"], value["backend"])


def _unaliased(outputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """``outputs`` with each one that shares memory with an earlier one cloned (a custom op's outputs may not
    alias each other; the Triton predictor returns the kv table's counts and indices as views of one buffer)."""
    seen, result = set(), []
    for tensor in outputs:
        storage = tensor.untyped_storage().data_ptr()
        result.append(tensor.clone() if storage in seen else tensor)
        seen.add(storage)
    return tuple(result)


def fake_mask_outputs(q: torch.Tensor, k: torch.Tensor, block_q: int, block_k: int) -> tuple[torch.Tensor, ...]:
    """Empty tensors shaped as a prediction op's outputs for q [B, H, N, D], k [B, H, M, D] (for fake kernels):
    keep bool [B, H, QB, KB], kv_count int32 [B, H, QB], kv_index int32 [B, H, QB, KB], kept mass float32
    [B, H, QB]."""
    batch, heads = q.shape[:2]
    qb, kb = num_blocks(q.shape[2], block_q), num_blocks(k.shape[2], block_k)
    return (q.new_empty((batch, heads, qb, kb), dtype=torch.bool),
            q.new_empty((batch, heads, qb), dtype=torch.int32),
            q.new_empty((batch, heads, qb, kb), dtype=torch.int32),
            q.new_empty((batch, heads, qb), dtype=torch.float32))


@_predict_mask_op.register_fake
def _(q, k, rule, topk, topk_is_count, topp, block_q, block_k, scale, keep_sink, keep_diagonal,
      similarity_threshold, min_blocks, backend):
    return fake_mask_outputs(q, k, block_q, block_k)


@with_settings_signature
def predict_mask_traced(q: torch.Tensor, k: torch.Tensor, settings: PredictSettings | None = None,
                        **options) -> tuple[SparseMask, torch.Tensor]:
    """``predict_mask`` for q [B, H, N, D], k [B, H, M, D] with scalar settings, traceable by torch.compile.

    ``settings`` and ``options`` as in :func:`~sparsevid.ops.predict.predict_mask` (no ``within``). Returns
    the mask (with its kv index tables) and the pooled mass each query-block row keeps, float32 [B, H, QB].
    Same checks and results as :func:`~sparsevid.ops.predict.predict_mask`.
    """
    if not torch.compiler.is_compiling():
        mask, stats = predict_mask(q, k, settings, **options)
        return mask, stats.kept_mass
    args = _op_arguments(settings, options)
    keep, count, index, kept_mass = _predict_mask_op(q, k, *args)
    block_q, block_k = args[4], args[5]
    mask = SparseMask.from_dense(keep, q.shape[2], k.shape[2], block_q, block_k, kv_table=(count, index))
    return mask, kept_mass
