"""Mixed-resolution batches: one clip shape per training step, in a fixed weighted cycle."""
from __future__ import annotations

import torch

from .procedural import ProceduralVideos


def weighted_cycle(weights: list[int]) -> list[int]:
    """The indices of ``weights`` in one period of a smooth weighted round robin: index i appears
    ``weights[i]`` times, spread out rather than bunched (weights [1, 1] -> [0, 1]; [2, 1] -> [0, 1, 0])."""
    if not weights or any(not isinstance(w, int) or isinstance(w, bool) or w < 1 for w in weights):
        raise ValueError(f"weights must be a non-empty list of ints >= 1, got {weights!r}")
    credit, cycle = [0] * len(weights), []
    for _ in range(sum(weights)):
        credit = [c + w for c, w in zip(credit, weights)]
        pick = max(range(len(weights)), key=lambda i: credit[i])  # ties: the earlier shape
        credit[pick] -= sum(weights)
        cycle.append(pick)
    return cycle


class ClipMix:
    """One :class:`ProceduralVideos` per clip shape, each with its batch size; step ``s`` draws from shape
    ``cycle[s % len(cycle)]`` (:func:`weighted_cycle` of ``weights``), so a run is reproducible and resumable.

    ``datasets``: the clip sources (their frames, height, width differ); ``batch_sizes``: clips per step for
    each; ``weights``: steps per cycle for each (default: one each, i.e. alternate).
    """

    def __init__(self, datasets: list[ProceduralVideos], batch_sizes: list[int], weights: list[int] | None = None):
        if not datasets:
            raise ValueError("datasets must not be empty")
        weights = [1] * len(datasets) if weights is None else list(weights)
        for name, values in (("batch_sizes", batch_sizes), ("weights", weights)):
            if len(values) != len(datasets):
                raise ValueError(f"{name} needs one entry per clip shape ({len(datasets)}), got {len(values)}")
        if any(not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in batch_sizes):
            raise ValueError(f"batch_sizes must be ints >= 1, got {batch_sizes!r}")
        self.datasets, self.batch_sizes = list(datasets), list(batch_sizes)
        self.weights, self.cycle = weights, weighted_cycle(weights)

    def shape_index(self, step: int) -> int:
        """Which clip shape step ``step`` (0-based) trains on."""
        return self.cycle[step % len(self.cycle)]

    def steps_per_shape(self, steps: int) -> list[int]:
        """How many of the first ``steps`` steps train on each shape."""
        counts = [0] * len(self.datasets)
        full, rest = divmod(steps, len(self.cycle))
        for position, index in enumerate(self.cycle):
            counts[index] += full + (position < rest)
        return counts

    def sample(self, step: int, generator: torch.Generator, device: torch.device | str = "cpu"
               ) -> tuple[torch.Tensor, list[str]]:
        """The batch of step ``step``: clips float32 [B, 3, T, H, W] in [-1, 1] and their B captions, with
        (B, T, H, W) those of shape :meth:`shape_index` ``(step)``."""
        index = self.shape_index(step)
        return self.datasets[index].sample(self.batch_sizes[index], generator, device)
