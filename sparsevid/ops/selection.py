"""Selection rules: which key blocks each query-block row keeps, given its pooled attention scores.

A row is a probability vector ``p`` over the KB key blocks. Each rule keeps the union of two sets:

* the top-k set: exactly ``k_eff`` entries, the largest ones, ties broken by the lowest key index (as a
  stable descending sort orders them); ``k_eff = max(k, min_blocks)`` ("topk", "hybrid") or ``min_blocks``
  ("topp"), capped at KB (or at the row's candidates);
* the top-p set ("topp", "hybrid"): every entry ``p_j >= tau_p``, where ``tau_p`` is the largest value whose
  entries reach the mass ``p_target`` (the fewest largest entries, plus any tied with the last of them). A
  row whose total falls short of the target (rounding), or a target of 1, keeps everything.

So "topk" keeps exactly k entries, "topp" the fewest largest entries whose mass reaches p_target, and
"hybrid" the union of the two. Options then add tiles: the sink column (key block 0), the diagonal (key blocks
overlapping the query block's token range) and the whole row / column of a query / key block whose
self-similarity is below the threshold.

Non-finite scores: a NaN or inf in q or k makes the pooled softmax of the affected rows NaN (a whole row at
once: the NaN reaches the row's normalization). Such scores count as 0, so the row still keeps its ``k_eff``
tiles (the lowest-index ones under "topk"); under "topp" and "hybrid" its mass falls short of any target, so
it keeps every tile. The attention kernels then see the non-finite tokens themselves and give NaN where
dense attention would (exactly so for rows kept in full). The rule never leaves a row with fewer than
``min_blocks`` tiles.

This module holds the parameter checks shared by every backend and the PyTorch (sort-based) rules; the
Triton kernels find the same sets by bisection without sorting.
"""
from __future__ import annotations

import math
import numbers

import torch

RULES = ("topk", "topp", "hybrid")


def uses_topk(rule: str) -> bool:
    return rule in ("topk", "hybrid")


def uses_topp(rule: str) -> bool:
    return rule in ("topp", "hybrid")


def _is_real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _check_per_head(name: str, value: torch.Tensor, heads: int) -> None:
    if value.shape != (heads,):
        raise ValueError(f"{name} as a tensor must have shape [H] = [{heads}], got {tuple(value.shape)}")
    if value.dtype == torch.bool or value.is_complex():
        raise TypeError(f"{name} as a tensor must be a real float or integer tensor, got dtype {value.dtype}")


def check_topk(topk) -> None:
    """Raise unless ``topk`` is a fraction in (0, 1] (float), a count >= 1 (int) or a real tensor (its values
    and shape are checked where the heads are known, :func:`resolve_topk`)."""
    if isinstance(topk, torch.Tensor):
        if topk.dtype == torch.bool or topk.is_complex():
            raise TypeError(f"topk as a tensor must be a real float or integer tensor, got dtype {topk.dtype}")
    elif isinstance(topk, numbers.Integral) and not isinstance(topk, bool):
        if topk < 1:
            raise ValueError(f"topk as an int count must be >= 1, got {topk}")
    elif _is_real(topk):
        if not 0 < topk <= 1:
            raise ValueError(f"topk as a fraction must lie in (0, 1], got {topk}")
    else:
        raise TypeError(f"topk must be a float fraction, an int count or a tensor [H], got {type(topk).__name__}")


def check_topp(topp) -> None:
    """Raise unless ``topp`` is a float in (0, 1] or a floating-point tensor (values checked by
    :func:`resolve_topp`)."""
    if isinstance(topp, torch.Tensor):
        if not topp.is_floating_point():
            raise TypeError(f"topp as a tensor must be floating point, got dtype {topp.dtype}")
    elif _is_real(topp):
        if not 0 < topp <= 1:
            raise ValueError(f"topp must lie in (0, 1], got {topp}")
    else:
        raise TypeError(f"topp must be a float in (0, 1] or a tensor [H], got {type(topp).__name__}")


def check_similarity_threshold(threshold) -> None:
    """Raise unless ``threshold`` is None, a float in [-1, 1] or a floating-point tensor (values checked by
    :func:`resolve_similarity_threshold`)."""
    if threshold is None:
        return
    if isinstance(threshold, torch.Tensor):
        if not threshold.is_floating_point():
            raise TypeError(f"similarity_threshold as a tensor must be floating point, got dtype {threshold.dtype}")
    elif _is_real(threshold):
        if not -1 <= threshold <= 1:
            raise ValueError(f"similarity_threshold must lie in [-1, 1], got {threshold}")
    else:
        raise TypeError(
            f"similarity_threshold must be None, a float in [-1, 1] or a tensor [H], got {type(threshold).__name__}"
        )


def resolve_topk(topk, num_kv_blocks: int, heads: int) -> int | torch.Tensor:
    """Number of key blocks the top-k rule keeps per row: an int, or int32 [H] for per-head values.

    topk: a fraction of KB in (0, 1] (float; rounded up, at least 1), a count >= 1 (int; capped at KB),
    or a tensor [H] of either kind (floating dtype: fractions, integer dtype: counts).
    """
    check_topk(topk)
    if isinstance(topk, torch.Tensor):
        _check_per_head("topk", topk, heads)
        if topk.is_floating_point():
            frac = topk.double()
            if not bool(((frac > 0) & (frac <= 1)).all()):
                raise ValueError(f"topk fractions must lie in (0, 1], got {topk.tolist()}")
            counts = torch.ceil(frac * num_kv_blocks - 1e-6)
        else:
            if not bool((topk >= 1).all()):
                raise ValueError(f"topk counts must be >= 1, got {topk.tolist()}")
            counts = topk
        return counts.clamp(1, num_kv_blocks).to(torch.int32)
    if isinstance(topk, numbers.Integral):
        return min(int(topk), num_kv_blocks)
    return min(max(1, math.ceil(float(topk) * num_kv_blocks - 1e-6)), num_kv_blocks)


def resolve_topp(topp, heads: int) -> float | torch.Tensor:
    """The cumulative pooled mass a row keeps: a float in (0, 1], or float32 [H] for per-head values."""
    check_topp(topp)
    if isinstance(topp, torch.Tensor):
        _check_per_head("topp", topp, heads)
        if not bool(((topp > 0) & (topp <= 1)).all()):
            raise ValueError(f"topp values must lie in (0, 1], got {topp.tolist()}")
        return topp.to(torch.float32)
    return float(topp)


def resolve_similarity_threshold(threshold, heads: int) -> float | torch.Tensor | None:
    """The block self-similarity below which a block is kept in full: None, a float in [-1, 1] or float32 [H]."""
    check_similarity_threshold(threshold)
    if threshold is None:
        return None
    if isinstance(threshold, torch.Tensor):
        _check_per_head("similarity_threshold", threshold, heads)
        if not bool(((threshold >= -1) & (threshold <= 1)).all()):
            raise ValueError(f"similarity_threshold values must lie in [-1, 1], got {threshold.tolist()}")
        return threshold.to(torch.float32)
    return float(threshold)


def _per_head(value, heads: int, dtype: torch.dtype, device) -> torch.Tensor:
    """value (scalar or [H]) as a [1, H, 1, 1] tensor for broadcasting over [B, H, QB, KB]."""
    return torch.as_tensor(value, dtype=dtype).to(device).expand(heads).view(1, heads, 1, 1)


def threshold_keep(scores: torch.Tensor, rule: str, topk: int | torch.Tensor | None,
                   topp: float | torch.Tensor | None, min_blocks: int,
                   candidates: torch.Tensor | None = None) -> torch.Tensor:
    """bool [B, H, QB, KB]: the tiles a rule keeps (module docstring), found by a stable sort of each row.

    scores: float32 [B, H, QB, KB], each row a probability vector (NaN counts as 0). topk: resolved count
    (int or int32 [H]), used by "topk" / "hybrid"; topp: resolved mass (float or float32 [H]), used by
    "topp" / "hybrid". candidates: None or bool broadcastable to scores: only these tiles can be kept, and
    they rank above every other tile (whose score should be 0).
    """
    heads, kb = scores.shape[1], scores.shape[-1]
    device = scores.device
    scores = torch.nan_to_num(scores, nan=0.0)
    if candidates is not None:
        scores = scores.where(candidates, -1.0)
    ordered, order = torch.sort(scores, dim=-1, descending=True, stable=True)
    k_eff = _per_head(topk if uses_topk(rule) else 0, heads, torch.int64, device).clamp_min(min_blocks)
    keep_sorted = (torch.arange(kb, device=device) < k_eff).expand(ordered.shape)
    if uses_topp(rule):
        target = _per_head(topp, heads, torch.float32, device)
        mass = torch.cumsum(ordered.clamp_min(0.0), dim=-1)
        # The threshold is the entry at which the cumulative mass first reaches the target; a row whose
        # rounded total falls short of it, or a target of 1, keeps everything.
        first = (mass < target).sum(dim=-1, keepdim=True).clamp_max(kb - 1)
        tau_p = torch.gather(ordered, -1, first)
        tau_p = torch.where(target >= 1, torch.full_like(tau_p, -1.0), tau_p)
        keep_sorted = keep_sorted | (ordered >= tau_p)
    keep = torch.zeros(ordered.shape, dtype=torch.bool, device=device).scatter_(-1, order, keep_sorted)
    return keep if candidates is None else keep & candidates


def diagonal_blocks(q_len: int, kv_len: int, block_q: int, block_k: int, device=None) -> torch.Tensor:
    """bool [QB, KB]: key blocks whose token range overlaps the query block's token range."""
    q_start = torch.arange(0, q_len, block_q, device=device)
    k_start = torch.arange(0, kv_len, block_k, device=device)
    q_stop = (q_start + block_q).clamp_max(q_len)
    k_stop = (k_start + block_k).clamp_max(kv_len)
    return (k_start[None, :] < q_stop[:, None]) & (q_start[:, None] < k_stop[None, :])


def add_option_blocks(keep: torch.Tensor, *, keep_sink: bool, diagonal: torch.Tensor | None,
                      q_similarity: torch.Tensor | None, k_similarity: torch.Tensor | None,
                      threshold: float | torch.Tensor | None) -> torch.Tensor:
    """keep bool [B, H, QB, KB] with the option tiles added (module docstring).

    diagonal: bool [QB, KB] or None; q_similarity: float32 [B, H, QB], k_similarity: float32 [B, H, KB]
    (block self-similarities; both or neither), compared with threshold (float or float32 [H]).
    """
    keep = keep.clone()
    if keep_sink:
        keep[..., 0] = True
    if diagonal is not None:
        keep |= diagonal
    if threshold is not None:
        limit = _per_head(threshold, keep.shape[1], torch.float32, keep.device)
        keep |= (q_similarity.unsqueeze(-1) < limit) | (k_similarity.unsqueeze(-2) < limit)
    return keep
