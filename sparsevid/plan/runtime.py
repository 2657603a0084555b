"""``LayerRuntime``: everything that decides one sparse layer's mask, in one object.

A runtime owns its layer's plan (from the :class:`~sparsevid.plan.config.SparseConfig`) and its mask-reuse
state (:class:`~sparsevid.plan.reuse.MaskReuse`). The call order is fixed:

1. once per transformer forward, :meth:`LayerRuntime.begin` with where the denoising is (a
   :class:`StepPosition`; host-side bookkeeping, skipped when the configuration does not vary with the step);
2. per attention call: :attr:`LayerRuntime.plan` (None: run dense), ``mask = runtime.mask(q, k, scale)``,
   the attention under that mask (emitting exact tile masses when :meth:`LayerRuntime.wants_tile_mass`),
   then :meth:`LayerRuntime.record` with those masses (or None).

Under ``torch.compile`` a plan without mask reuse is traced (the prediction is a custom op); reuse keeps masks
across steps in Python state and runs eagerly (``torch.compiler.disable``), so it never makes the graph
depend on the step index.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..ops import SparseMask
from .config import LayerPlan, SparseConfig
from .reuse import MaskReuse, predict_plan_mask


@dataclass(frozen=True)
class StepPosition:
    """Where a forward sits in the denoising: ``step`` (None: unknown) with its ``timestep`` value, the
    guidance ``branch`` within the step and the ``generation`` (changes when a new generation starts)."""

    step: int | None = None
    timestep: float | None = None
    branch: int = 0
    generation: int = 0


class LayerRuntime:
    """The mask decision of self-attention ``layer`` under ``config`` (see the module docstring).

    Attributes:
        plan: the LayerPlan of the current forward, None for dense.
        source: how the last mask was obtained: "predicted", "reused", "within" or "exact".
    """

    def __init__(self, layer: int, config: SparseConfig):
        self.layer = layer
        self.config = config
        self.position = StepPosition()
        self.plan: LayerPlan | None = config.plan(layer, None)
        self.source: str | None = None
        self._reuse = MaskReuse()

    def begin(self, position: StepPosition) -> LayerPlan | None:
        """Start a forward at ``position``: returns (and keeps) this layer's plan for it."""
        self.position = position
        self.plan = self.config.plan(self.layer, position.step, position.timestep)
        return self.plan

    def mask(self, q: torch.Tensor, k: torch.Tensor, scale: float | None, heads: range | None = None) -> SparseMask:
        """The mask of this call over video q [B, H, N, D], k [B, H, M, D] (a sparse plan is required); ``heads``:
        the layer's global heads that q holds (None: all; under context parallelism a rank's share), whose
        slice of per-head budgets applies.

        Masks are not differentiable: they are made under ``torch.no_grad()``, so that a forward recomputed by
        gradient checkpointing (which reuses the mask its first run kept) saves the same tensors."""
        if self.plan is None:
            raise RuntimeError(f"layer {self.layer} is dense at this step: it has no mask")
        with torch.no_grad():
            if self.plan.reuses_masks:
                return self._reused_mask(q, k, scale, heads)
            self.source = "predicted"
            return predict_plan_mask(q, k, self.plan, scale, heads=heads)[0]

    @torch.compiler.disable
    def _reused_mask(self, q: torch.Tensor, k: torch.Tensor, scale: float | None, heads: range | None) -> SparseMask:
        where = self.position
        mask, self.source = self._reuse.mask(q, k, self.plan, scale, step=where.step, branch=where.branch,
                                             generation=where.generation, heads=heads)
        return mask

    def wants_tile_mass(self, q: torch.Tensor) -> bool:
        """Whether the attention of the call about to get its mask should also return its exact tile masses
        (for :meth:`record`; asked before :meth:`mask`)."""
        if self.plan is None or self.plan.refresh_search != "exact":
            return False
        return self._reuse.wants_tile_mass(q, self.plan, step=self.position.step, branch=self.position.branch)

    def record(self, tile_mass: torch.Tensor | None) -> None:
        """Keep the exact tile masses float32 [B, H, QB, KB] the attention under this call's mask produced
        (None: none were asked for)."""
        if tile_mass is not None:
            self._reuse.record_tile_mass(tile_mass, step=self.position.step, branch=self.position.branch)
