"""Per-transformer runtime state: the denoising step, the latent grid and per-forward values.

A forward pre-hook on the transformer (installed by ``apply_sparse_attention``) calls
:meth:`StepContext.begin_forward` with the ``timestep`` argument and the latent grid. The step index
counts distinct timesteps of one generation: a timestep equal to the previous one is the same step
(e.g. the unconditional pass of classifier-free guidance), a smaller one the next step, a larger one
the start of a new generation (step 0). :meth:`reset` or :meth:`set_step` override the counting.
:meth:`begin_order` then sets the video token order the forward runs in (see ``token_order``).

The counting runs on the timestep's device (a :class:`StepCounter`), so a forward never waits for the
device: :attr:`StepContext.step` and the other positions read it back only when asked (the integration
asks only when the configuration varies with the step, or stats are on).
"""
from __future__ import annotations

import contextlib
import struct
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..plan.runtime import StepPosition
from .joint_attention import TokenOrder
from .stats import Clock, ForwardRecord

# Counter slots: the last timestep (float64 bits), step, branch, generation.
_TIMESTEP, _STEP, _BRANCH, _GENERATION = range(4)
_NO_TIMESTEP = struct.unpack("<q", struct.pack("<d", float("-inf")))[0]  # -inf as float64 bits: any timestep is larger


def _fill_slot(counter: torch.Tensor, slot: int, value: int) -> None:
    """``counter[slot] = value`` as a fill kernel: assigning a Python number to one element of a CUDA tensor
    copies it from host memory, and that copy waits for the device."""
    counter[slot:slot + 1].fill_(value)


def fresh_counter(device: torch.device | str | None = None) -> torch.Tensor:
    """A counter before any forward: int64 [4] (int64 so that ``module.to(dtype)`` leaves it alone)."""
    counter = torch.zeros(4, dtype=torch.int64, device=device)
    _fill_slot(counter, _TIMESTEP, _NO_TIMESTEP)
    return counter


def advance_counter(counter: torch.Tensor, value: torch.Tensor, pinned_step: int | None) -> torch.Tensor:
    """The counter after a forward at timestep ``value`` (float64 scalar on the counter's device), without a
    host read: a larger timestep starts a new generation at step 0, a smaller one is the next step, an equal
    one the next guidance branch of the same step. ``pinned_step`` replaces the counted step."""
    last = counter[_TIMESTEP:_TIMESTEP + 1].view(torch.float64)[0]
    step, branch, generation = counter[_STEP], counter[_BRANCH], counter[_GENERATION]
    new_generation = value > last
    new_step = torch.where(new_generation, 0, torch.where(value < last, step + 1, step))
    if pinned_step is not None:
        new_step = torch.full_like(step, pinned_step)
    same_step = (value == last) & (new_step == step)
    return torch.stack([value.reshape(1).view(torch.int64)[0], new_step,
                        torch.where(same_step, branch + 1, 0), generation + new_generation.long()])


@dataclass
class ForwardValues:
    """Values the sparse layers of one forward share, computed by the first layer that needs them.

    Attributes:
        token_orders: {(tile, leading tokens): TokenOrder or None}, the reordering from the forward's token order to
            a tile's.
        key_sets: (the attention mask, its valid text keys per batch entry) or None.
        packed: (text mask, RoPE tables, their ``PackedBatch``) of a processor that attends each entry alone, or None.
    """

    token_orders: dict = field(default_factory=dict)
    key_sets: tuple | None = None
    packed: tuple | None = None


@dataclass
class StepContext:
    """Mutable state shared by the sparse processors of one transformer.

    Attributes:
        counter: int64 [4] on the timestep's device (see :func:`advance_counter`); the integration keeps it as a
            non-persistent buffer of the transformer so that it follows ``transformer.to(device)``.
        has_timestep: whether the current forward had a timestep (else the step is unknown).
        grid: (T, H, W) latent token grid of the current forward after patching, or None.
        values: per-forward shared values (:class:`ForwardValues`), fresh every forward.
        collect_stats: record per-layer stats (see ``attention_stats``).
        dense: every layer runs dense for now (``dense_attention``).
        measure: a per-head calibration's measurement (``sparsevid.eval.calibrate``), called by every dense layer
            with its video attention (``SparseAttnProcessor._measure``), or None.
        records: the stats records of the last forward.
        tile: the 3D tile the video tokens of the current forward are ordered in, None for raster order.
        order: that order as a permutation of the raster tokens (None for raster order).
        reordering: inside a forward that runs in ``order`` (the token-order hooks act only then).
        forward_record: the per-forward stats record of the last forward (with stats on); the layers' records
            share its step.
    """

    counter: torch.Tensor = field(default_factory=fresh_counter)
    has_timestep: bool = False
    grid: tuple[int, int, int] | None = None
    values: ForwardValues = field(default_factory=ForwardValues)
    collect_stats: bool = False
    dense: bool = False
    measure: Callable | None = None
    records: list = field(default_factory=list)
    tile: tuple[int, int, int] | None = None
    order: TokenOrder | None = None
    reordering: bool = False
    forward_record: ForwardRecord | None = None
    _pinned_step: int | None = None
    # The host knows the position of the first forward after reset() (or ever): step 0 (or the pinned step),
    # branch 0, the next generation. _generation is the generation the host last knew. Both are kept by
    # position() alone, so that begin_forward (traced by torch.compile) branches on nothing that changes.
    _fresh: bool = True
    _generation: int = 0

    def begin_forward(self, timestep, grid: tuple[int, int, int] | None) -> None:
        """Advance the step counter from ``timestep`` (tensor or number; its largest entry; no host read) and
        set the grid."""
        if isinstance(timestep, torch.Tensor) and timestep.numel() == 0:
            timestep = None
        self.has_timestep = timestep is not None
        if timestep is not None:
            if isinstance(timestep, torch.Tensor):
                value = timestep.detach().max().to(device=self.counter.device, dtype=torch.float64)
            else:  # a fill, not torch.tensor: a host-to-device copy would wait for the device
                value = torch.full((), float(timestep), dtype=torch.float64, device=self.counter.device)
            self.counter.copy_(advance_counter(self.counter, value, self._pinned_step))
        self.grid = grid
        self.values = ForwardValues()
        self.records = []

    # Positions of the last forward: each reads the device.
    @property
    def step(self) -> int | None:
        """Denoising step of the current forward (None before the first forward or without a timestep)."""
        return int(self.counter[_STEP]) if self.has_timestep else None

    @property
    def timestep(self) -> float | None:
        """The timestep value of the current forward (largest entry of the ``timestep`` tensor)."""
        return float(self.counter[_TIMESTEP:_TIMESTEP + 1].view(torch.float64)[0]) if self.has_timestep else None

    @property
    def branch(self) -> int:
        """Index of the current forward among the forwards of its step (0, then 1 for the second pass of
        classifier-free guidance when the pipeline makes two calls)."""
        return int(self.counter[_BRANCH]) if self.has_timestep else 0

    @property
    def generation(self) -> int:
        """Incremented when a new generation starts (per-layer mask reuse then drops its masks)."""
        return int(self.counter[_GENERATION])

    def position(self, with_timestep: bool = True) -> StepPosition:
        """The (step, timestep, branch, generation) of the current forward as a ``StepPosition``: one host read,
        none for the first forward after :meth:`reset` unless ``with_timestep`` (its timestep is then None).
        Call it once per forward (after :meth:`begin_forward`) or never: it counts the forwards after a reset."""
        if not self.has_timestep:
            return StepPosition(None, None, 0, self._generation)
        fresh, self._fresh = self._fresh, False
        if fresh and not with_timestep:
            self._generation += 1
            return StepPosition(self._pinned_step or 0, None, 0, self._generation)
        timestep_bits, step, branch, self._generation = self.counter.tolist()
        timestep = struct.unpack("<d", struct.pack("<q", timestep_bits))[0]
        return StepPosition(step, timestep, branch, self._generation)

    def begin_order(self, tile: tuple[int, int, int] | None, order: TokenOrder | None, device: torch.device) -> None:
        """Set the video token order of the current forward (after :meth:`begin_forward`); starts its stats record
        (whose step stays on the device until the record is read)."""
        self.tile, self.order = tile, order
        self.forward_record = None
        if self.collect_stats:
            step = self.counter[_STEP].clone() if self.has_timestep else None
            self.forward_record = ForwardRecord(step, tile, Clock(device))

    def forward_span(self, kind: str):
        """Context timing a token-order span of the current forward ("reorder" | "restore") when stats are on."""
        return contextlib.nullcontext() if self.forward_record is None else self.forward_record.span(kind)

    def reset(self) -> None:
        """Forget the step count: the next forward is step 0 of a new generation (no host read, no sync: a
        training loop calls it before every forward)."""
        _fill_slot(self.counter, _TIMESTEP, _NO_TIMESTEP)
        self._fresh = True
        self.has_timestep = False
        self._pinned_step = None

    def set_step(self, step: int | None) -> None:
        """Pin the step index used by every following forward (None resumes automatic counting)."""
        if step is not None and (not isinstance(step, int) or isinstance(step, bool) or step < 0):
            raise ValueError(f"step must be None or an int >= 0, got {step!r}")
        self._pinned_step = step
        if step is not None:
            _fill_slot(self.counter, _STEP, step)
