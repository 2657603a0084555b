"""The budgets a rule applies in one prediction: the top-k count of the call's key blocks and the top-p mass, each
a scalar or, per head, a tensor [H] on the inputs' device.

:func:`resolve_budgets` checks, converts and moves them on every call (what ``predict_mask`` does with budgets it
is handed). :func:`reused_budgets` does that once per settings object, head count, key-block count and device:
settings used for many calls (a layer plan's) then cost a dictionary look-up per call, with no host-side check, no
conversion and no host-to-device copy. Such settings, and the per-head tensors :func:`head_slice` slices, are read
once: their tensors must not be changed in place afterwards (new values belong in new settings).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

from .selection import resolve_topk, resolve_topp
from .settings import PredictSettings

T = TypeVar("T")


class ByIdentity:
    """A bounded cache of values made from objects told apart by identity (settings and tensors, whose ``==`` is no
    plain bool). Each entry keeps its objects alive, so that no other object can take their ids while it exists:
    a key's ids name the very objects it was made from."""

    def __init__(self, limit: int = 1024):
        self._entries: dict[tuple, tuple[tuple, object]] = {}
        self._limit = limit

    def get(self, objects: tuple, extra: tuple, make: Callable[[], T]) -> T:
        """The value of ``objects`` and the hashable ``extra``, made by ``make()`` the first time."""
        key = (*map(id, objects), *extra)
        entry = self._entries.get(key)
        if entry is not None:
            return entry[1]
        if len(self._entries) >= self._limit:
            self._entries.clear()
        value = make()
        self._entries[key] = (objects, value)
        return value


def has_head_budgets(settings: PredictSettings) -> bool:
    """Whether ``settings`` hold a per-head ``topk`` or ``topp`` (a tensor [H])."""
    return isinstance(settings.topk, torch.Tensor) or isinstance(settings.topp, torch.Tensor)


def head_slice(settings: PredictSettings, heads: range | None) -> PredictSettings:
    """``settings`` whose per-head ``topk`` and ``topp`` (both tensors [H], as a layer plan makes them) are cut to
    the global ``heads`` a call holds ([H'] views; None: all heads, ``settings`` itself)."""
    if heads is None:
        return settings
    count = settings.topk.numel()
    if heads.stop > count:
        raise ValueError(f"the plan gives {count} per-head budgets, but the call holds heads "
                         f"{heads.start}..{heads.stop - 1}")
    return settings.replace(topk=settings.topk[heads.start:heads.stop], topp=settings.topp[heads.start:heads.stop])


def _to_device(value, device: torch.device):
    """A resolved per-head budget [H] on ``device``, copied without waiting for the device (its values were
    checked on the host); scalars as they are."""
    return value.to(device, non_blocking=True) if isinstance(value, torch.Tensor) else value


def resolve_budgets(settings: PredictSettings, num_kv_blocks: int, heads: int, device: torch.device) -> tuple:
    """(rule_topk, rule_topp) of ``settings`` for a call of ``heads`` heads and ``num_kv_blocks`` key blocks on
    ``device``, checked and converted now (``selection.resolve_topk`` / ``resolve_topp``): the top-k count, an int
    or int32 [H], and the top-p mass, a float or float32 [H]; None for a part the rule does not use."""
    topk = resolve_topk(settings.topk, num_kv_blocks, heads) if settings.uses_topk else None
    topp = resolve_topp(settings.topp, heads) if settings.uses_topp else None
    return _to_device(topk, device), _to_device(topp, device)


_REUSED = ByIdentity()


def reused_budgets(settings: PredictSettings, num_kv_blocks: int, heads: int, device: torch.device) -> tuple:
    """:func:`resolve_budgets`, resolved once per settings object, key-block count, head count and device; scalar
    budgets are resolved every call (a few arithmetic operations on the host)."""
    if not has_head_budgets(settings):
        return resolve_budgets(settings, num_kv_blocks, heads, device)
    return _REUSED.get((settings,), (num_kv_blocks, heads, device),
                       lambda: resolve_budgets(settings, num_kv_blocks, heads, device))
