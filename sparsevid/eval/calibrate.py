"""Rule settings that reach a target sparsity on a model's own attention.

Top-k reaches a sparsity by construction (it keeps the fraction 1 - s of the key blocks, rounded up); top-p
and the hybrid rule reach one only through the attention they see. :func:`calibrate_rules` takes the video
self-attention q, k recorded from a model's dense forward passes (3D-tiled token order, as the sparse processors
see them) and finds, by bisection on p, the top-p threshold (and the hybrid's, with top-k (1 - s) / 2) whose
predicted masks have mean sparsity s over those calls.
"""
from __future__ import annotations

from typing import Sequence

from ..ops import DEFAULT_BLOCK_K, DEFAULT_BLOCK_Q

BISECTION_STEPS = 14


def mean_sparsity(calls, block_q: int = DEFAULT_BLOCK_Q, block_k: int = DEFAULT_BLOCK_K, **rule) -> float:
    """Mean sparsity of the masks ``sparsevid.predict_mask(q, k, **rule)`` predicts over recorded ``calls``."""
    from ..ops import predict_mask

    return sum(predict_mask(q, k, block_q=block_q, block_k=block_k, **rule)[0].sparsity for q, k in calls) / len(calls)


def calibrate_topp(calls, target: float, topk: float | None = None, **blocks) -> float:
    """p in (0, 1] whose mean predicted sparsity over ``calls`` is closest to ``target`` (bisection); the top-p
    rule, or the hybrid rule with ``topk``."""
    rule = dict(rule="topp") if topk is None else dict(rule="hybrid", topk=topk)
    low, high = 1e-4, 1.0
    for _ in range(BISECTION_STEPS):
        mid = (low + high) / 2
        if mean_sparsity(calls, topp=mid, **rule, **blocks) > target:
            low = mid  # too sparse: keep more mass
        else:
            high = mid
    return (low + high) / 2


def check_targets(targets: Sequence[float]) -> None:
    if not targets or not all(isinstance(s, (int, float)) and 0 < s < 1 for s in targets):
        raise ValueError(f"targets must be sparsities in (0, 1), got {targets!r}")


def calibrate_rules(calls, targets: Sequence[float], block_q: int = DEFAULT_BLOCK_Q,
                    block_k: int = DEFAULT_BLOCK_K) -> dict:
    """{label: SparseConfig}: top-k, top-p and hybrid at every target sparsity in ``targets`` (each in (0, 1)),
    calibrated on recorded ``calls`` (:func:`record_video_attention`); labels like "topp 90%"."""
    from ..plan import SparseConfig

    check_targets(targets)
    blocks = dict(block_q=block_q, block_k=block_k)
    configs = {}
    for target in targets:
        keep = round(1.0 - target, 4)
        configs[f"topk {target:.0%}"] = SparseConfig(rule="topk", topk=keep, **blocks)
        configs[f"topp {target:.0%}"] = SparseConfig(rule="topp", topp=round(calibrate_topp(calls, target, **blocks), 5),
                                                     **blocks)
        configs[f"hybrid {target:.0%}"] = SparseConfig(
            rule="hybrid", topk=keep / 2, topp=round(calibrate_topp(calls, target, keep / 2, **blocks), 5), **blocks)
    return configs
