"""Per-layer attention and per-forward token-order statistics, recorded without host syncs and read on request.

Timings use CUDA events on CUDA tensors (resolved when the stats are read) and ``time.perf_counter``
elsewhere; the sparsity and the step stay device tensors until read.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch


class Clock:
    """Named time marks on one device; :meth:`elapsed_ms` reads two of them (syncs on CUDA)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: dict[str, object] = {}

    def mark(self, name: str) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks[name] = event
        else:
            self.marks[name] = time.perf_counter()

    def elapsed_ms(self, start: str, end: str) -> float | None:
        if start not in self.marks or end not in self.marks:
            return None
        if self.cuda:
            self.marks[end].synchronize()
            return float(self.marks[start].elapsed_time(self.marks[end]))
        return (self.marks[end] - self.marks[start]) * 1e3


def mark(clock: Clock | None, name: str) -> None:
    """``clock.mark(name)`` when there is a clock (stats on), else nothing."""
    if clock is not None:
        clock.mark(name)


def mark_first(clock: Clock | None, name: str) -> None:
    """:func:`mark` unless ``name`` is marked already: the first of a layer's several attention calls (Mochi's dense
    call per batch entry) starts its span."""
    if clock is not None and name not in clock.marks:
        clock.mark(name)


def _host_step(step: torch.Tensor | int | None) -> int | None:
    return None if step is None else int(step)


@dataclass
class AttentionRecord:
    """One self-attention call: layer, step (a device scalar until read), whether it ran dense, its
    video-to-video sparsity, timings."""

    layer: int
    step: torch.Tensor | int | None
    dense: bool
    video_tokens: int
    text_tokens: int
    clock: Clock
    sparsity: torch.Tensor | None = None
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        """Plain numbers (reads device values: call after the forward, not inside it)."""
        return {
            "layer": self.layer,
            "step": _host_step(self.step),
            "dense": self.dense,
            "video_tokens": self.video_tokens,
            "text_tokens": self.text_tokens,
            "sparsity": 0.0 if self.sparsity is None else float(self.sparsity),
            "attention_ms": self.clock.elapsed_ms("start", "end"),
            "reorder_ms": self.clock.elapsed_ms("start", "reordered"),
            "predict_ms": self.clock.elapsed_ms("reordered", "predicted"),
            "kernel_ms": self.clock.elapsed_ms("predicted", "attended"),
            "restore_ms": self.clock.elapsed_ms("attended", "end"),
            **self.extra,
        }


@dataclass
class ForwardRecord:
    """One transformer forward: its step (a device scalar until read), the token order it ran in (a tile or
    None for raster order) and the time spent putting tokens into that order ("reorder": patch embedding, RoPE
    tables, per-token inputs) and back ("restore": the output projection's tokens)."""

    step: torch.Tensor | int | None
    tile: tuple[int, int, int] | None
    clock: Clock
    spans: list[tuple[str, str, str]] = field(default_factory=list)

    @contextlib.contextmanager
    def span(self, kind: str):
        """Time the body as one more span of ``kind`` ("reorder" or "restore")."""
        start, end = f"{len(self.spans)}:start", f"{len(self.spans)}:end"
        self.clock.mark(start)
        yield
        self.clock.mark(end)
        self.spans.append((kind, start, end))

    def as_dict(self) -> dict:
        """Plain numbers (reads device values: call after the forward, not inside it)."""
        totals = {"reorder_ms": 0.0, "restore_ms": 0.0}
        for kind, start, end in self.spans:
            totals[f"{kind}_ms"] += self.clock.elapsed_ms(start, end)
        return {"step": _host_step(self.step), "tile": self.tile, **totals}
