"""Mask reuse across denoising steps, and the reduced search when a reused mask is refreshed.

Attention maps of a video DiT change slowly from one denoising step to the next. :class:`MaskReuse` keeps,
for one sparse layer, the last mask of each guidance branch with the step it was made at:

* step ``s`` with no usable mask (first sparse step, new generation, other shape or block sizes): predict a
  mask over all tiles;
* steps ``s + 1 ... s + refresh_interval - 1``: reuse it, no search at all;
* step ``s + refresh_interval``: refresh it with the plan's budget of that step, searching as
  ``plan.refresh_search`` says: "full" (all tiles again), "within" (``predict_mask(within=old mask)``:
  only the old mask's tiles are candidates) or "exact" (``select_from_mass`` over the exact tile masses the
  old mask's attention produced at step ``s + refresh_interval - 1``; "within" when none were recorded).

"within" and "exact" give a subset of the old mask, so the search shrinks as sparsity grows. Each entry
also carries the share of the full attention row its mask holds (the pooled ``kept_mass`` at prediction,
times the exact mass kept at every "exact" refresh), so the rules' ``topp`` stays a share of the full row.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..ops import PredictSettings, SparseMask, select_from_mass
from ..ops.attention import TILE_MASS_BACKENDS
from ..ops.budgets import ByIdentity, has_head_budgets, head_slice
from ..ops.predict import predict_reused
from ..ops.predict_op import predict_mask_traced
from .config import LayerPlan


@dataclass
class _Entry:
    """The last mask of one branch: made at ``step`` under ``plan``; ``share`` float32 [B, H, QB] is the share
    of the full attention row it holds; ``tile_mass`` float32 [B, H, QB, KB] its attention's exact tile
    masses at ``mass_step`` (or None)."""

    mask: SparseMask
    step: int
    plan: LayerPlan
    share: torch.Tensor
    tile_mass: torch.Tensor | None = None
    mass_step: int | None = None

    def fits(self, q: torch.Tensor, k: torch.Tensor, plan: LayerPlan) -> bool:
        keep = self.mask.keep
        return (keep.shape[:2] == q.shape[:2] and keep.device == q.device
                and (self.mask.q_len, self.mask.kv_len) == (q.shape[2], k.shape[2])
                and (self.plan.block_q, self.plan.block_k, self.plan.tile) == (plan.block_q, plan.block_k, plan.tile))


def predict_plan_mask(q, k, plan: LayerPlan, scale, within: SparseMask | None = None, heads: range | None = None):
    """The mask a layer's plan predicts for video q, k [B, H', Nv, D] (``within``: search only its tiles), and
    the pooled mass each query-block row keeps, float32 [B, H', QB]. ``heads``: the global heads the call holds
    (None: all of the layer's), whose slice of per-head budgets applies. Without ``within`` torch.compile
    traces it (a custom op, ``sparsevid.ops.predict_op``). Per-head budgets are resolved and moved to the device
    once per plan, slice, key-block count and device, eagerly (``call_settings``, ``predict_reused``) and compiled."""
    if within is None and torch.compiler.is_compiling():
        return predict_mask_traced(q, k, plan.predict_settings, scale, heads)
    mask, stats = predict_reused(q, k, call_settings(plan.predict_settings, scale, heads), within=within)
    return mask, stats.kept_mass


_CALLS = ByIdentity()


def call_settings(settings: PredictSettings, scale: float | None, heads: range | None = None) -> PredictSettings:
    """``settings`` with this call's scale and, for per-head budgets, the slice of the global ``heads`` the call
    holds (None: all). Cached by the settings' identity (plans share their settings objects, and equality would
    not tell a count topk=1 from a fraction topk=1.0): a layer's eager calls repeat it, a new settings object is
    checked field by field, and ``predict_reused`` resolves the per-head budgets of each returned object once."""
    def make() -> PredictSettings:
        sliced = head_slice(settings, heads) if has_head_budgets(settings) else settings
        return sliced.replace(scale=scale)

    return _CALLS.get((settings,), (type(scale), scale, heads), make)


class MaskReuse:
    """The masks of one sparse layer across the steps of a generation, one entry per guidance branch."""

    def __init__(self) -> None:
        self._entries: dict[int, _Entry] = {}
        self._generation: int | None = None

    def clear(self) -> None:
        self._entries.clear()

    def mask(self, q: torch.Tensor, k: torch.Tensor, plan: LayerPlan, scale: float | None, *, step: int | None,
             branch: int = 0, generation: int = 0, heads: range | None = None) -> tuple[SparseMask, str]:
        """The mask for this call over q [B, H, N, D], k [B, H, M, D] and how it was obtained: "predicted",
        "reused", "within" or "exact" (the integration's stats report it as ``mask_source``).

        step: the denoising step (None: unknown, predict and keep nothing); branch: the guidance pass within
        the step; generation: changes when a new generation starts, which drops every kept mask; heads: the global
        heads q holds (None: all).
        """
        if generation != self._generation:
            self.clear()
            self._generation = generation
        entry = self._entries.get(branch)
        if step is None or entry is None or step < entry.step or not entry.fits(q, k, plan):
            return self._keep(branch, step, plan, *predict_plan_mask(q, k, plan, scale, heads=heads), "predicted")
        if step - entry.step < plan.refresh_interval:
            return entry.mask, "reused"
        if plan.refresh_search == "full":
            return self._keep(branch, step, plan, *predict_plan_mask(q, k, plan, scale, heads=heads), "predicted")
        if plan.refresh_search == "exact" and entry.tile_mass is not None and entry.mass_step == step - 1:
            mask, stats = select_from_mass(entry.tile_mass, entry.mask, call_settings(plan.predict_settings, None, heads),
                                           row_share=entry.share)
            return self._keep(branch, step, plan, mask, stats.kept_mass, "exact")
        return self._keep(branch, step, plan, *predict_plan_mask(q, k, plan, scale, within=entry.mask,
                                                                       heads=heads), "within")

    def wants_tile_mass(self, q: torch.Tensor, plan: LayerPlan, *, step: int | None, branch: int = 0) -> bool:
        """Whether the attention of the call about to get its mask from :meth:`mask` should emit exact tile
        masses: the "exact" search is on, the next step refreshes the mask, the backend can emit them and no
        gradient is requested. (Asked before :meth:`mask`; a mask made at this step is due at step + interval.)"""
        if plan.refresh_search != "exact" or step is None or plan.backend not in ("auto",) + TILE_MASS_BACKENDS:
            return False
        if torch.is_grad_enabled() and q.requires_grad:
            return False
        entry = self._entries.get(branch)
        made_at = step if entry is None or not 0 <= step - entry.step < plan.refresh_interval else entry.step
        return step + 1 - made_at >= plan.refresh_interval

    def record_tile_mass(self, tile_mass: torch.Tensor, *, step: int, branch: int = 0) -> None:
        """Keep the exact tile masses float32 [B, H, QB, KB] that this step's attention gave the mask
        :meth:`mask` returned for the branch at this step."""
        entry = self._entries[branch]
        entry.tile_mass, entry.mass_step = tile_mass, step

    def _keep(self, branch: int, step: int | None, plan: LayerPlan, mask: SparseMask, share: torch.Tensor,
              source: str) -> tuple[SparseMask, str]:
        if step is not None and (plan.refresh_interval > 1 or plan.refresh_search != "full"):
            self._entries[branch] = _Entry(mask, step, plan, share)
        return mask, source
