"""Per-transformer runtime state: the denoising step, the latent grid and per-forward caches.

A forward pre-hook on the transformer (installed by ``apply_sparse_attention``) calls
:meth:`StepContext.begin_forward` with the ``timestep`` argument and the latent grid. The step index
counts distinct timesteps of one generation: a timestep equal to the previous one is the same step
(e.g. the unconditional pass of classifier-free guidance), a smaller one the next step, a larger one
the start of a new generation (step 0). :meth:`reset` or :meth:`set_step` override the counting.
:meth:`begin_order` then sets the video token order the forward runs in (see ``token_order``).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from .joint_attention import TokenOrder
from .stats import Clock, ForwardRecord


@dataclass
class StepContext:
    """Mutable state shared by the sparse processors of one transformer.

    Attributes:
        step: denoising step of the current forward (None before the first forward).
        timestep: the timestep value of the current forward (largest entry of the ``timestep`` tensor).
        grid: (T, H, W) latent token grid of the current forward after patching, or None.
        forward_cache: values computed once per forward (the valid text keys, per-layer token orders), cleared by
            every forward.
        collect_stats: record per-layer stats (see ``attention_stats``).
        branch: index of the current forward among the forwards of its step (0, then 1 for the second pass of
            classifier-free guidance when the pipeline makes two calls).
        generation: incremented when a new generation starts (per-layer mask caches drop their masks).
        records: the stats records of the last forward.
        tile: the 3D tile the video tokens of the current forward are ordered in, None for raster order.
        order: that order as a permutation of the raster tokens (None for raster order).
        reordering: inside a forward that runs in ``order`` (the token-order hooks act only then).
        forward_record: the per-forward stats record of the last forward (with stats on).
    """

    step: int | None = None
    timestep: float | None = None
    branch: int = 0
    generation: int = 0
    grid: tuple[int, int, int] | None = None
    forward_cache: dict = field(default_factory=dict)
    collect_stats: bool = False
    records: list = field(default_factory=list)
    tile: tuple[int, int, int] | None = None
    order: TokenOrder | None = None
    reordering: bool = False
    forward_record: ForwardRecord | None = None
    _pinned_step: int | None = None

    def begin_forward(self, timestep, grid: tuple[int, int, int] | None) -> None:
        """Advance the step counter from ``timestep`` (tensor or number; one host read) and set the grid."""
        if isinstance(timestep, torch.Tensor):
            value = float(timestep.detach().max()) if timestep.numel() else None
        elif timestep is not None:
            value = float(timestep)
        else:
            value = None
        previous_step = self.step
        if self._pinned_step is not None:
            self.step = self._pinned_step
        elif value is None:
            self.step = None
        elif self.timestep is None or self.step is None or value > self.timestep:
            self.step = 0
            self.generation += 1
        elif value < self.timestep:
            self.step += 1
        same_step = value is not None and value == self.timestep and self.step == previous_step
        self.branch = self.branch + 1 if same_step else 0
        self.timestep = value
        self.grid = grid
        self.forward_cache.clear()
        self.records = []

    def begin_order(self, tile: tuple[int, int, int] | None, order: TokenOrder | None, device: torch.device) -> None:
        """Set the video token order of the current forward (after :meth:`begin_forward`); starts its stats record."""
        self.tile, self.order = tile, order
        self.forward_record = ForwardRecord(self.step, tile, Clock(device)) if self.collect_stats else None

    def forward_span(self, kind: str):
        """Context timing a token-order span of the current forward ("reorder" | "restore") when stats are on."""
        return contextlib.nullcontext() if self.forward_record is None else self.forward_record.span(kind)

    def reset(self) -> None:
        """Forget the step count: the next forward is step 0 of a new generation."""
        self.step = None
        self.timestep = None
        self._pinned_step = None

    def set_step(self, step: int | None) -> None:
        """Pin the step index used by every following forward (None resumes automatic counting)."""
        if step is not None and (not isinstance(step, int) or isinstance(step, bool) or step < 0):
            raise ValueError(f"step must be None or an int >= 0, got {step!r}")
        self._pinned_step = step
        if step is not None:
            self.step = step
