"""Random draws keyed by a global sample index, so that every rank of a data-parallel job (and a resumed run)
draws exactly what the index names, whatever the world size: a seed per (run seed, sample index, stream)."""
from __future__ import annotations

import torch

MASK64 = (1 << 64) - 1
STREAM_DATA, STREAM_NOISE, STREAM_SHUFFLE, STREAM_TEACHER = 1, 2, 3, 4


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def sample_seed(seed: int, index: int, stream: int) -> int:
    """A 63-bit seed for sample ``index`` of random ``stream`` in a run seeded by ``seed``."""
    return _splitmix64(_splitmix64(_splitmix64(seed) ^ stream) ^ index) >> 1


def sample_generator(seed: int, index: int, stream: int) -> torch.Generator:
    """A CPU generator for sample ``index`` of ``stream`` (see :func:`sample_seed`)."""
    return torch.Generator().manual_seed(sample_seed(seed, index, stream))


class EpochOrder:
    """Epochs over ``count`` items, each in a fresh random order seeded by ``seed``: global index ``i`` is position
    ``i % count`` of epoch ``i // count``'s permutation (the current epoch's permutation is kept)."""

    def __init__(self, count: int, seed: int = 0):
        if not isinstance(count, int) or count < 1:
            raise ValueError(f"count must be a positive int, got {count!r}")
        self.count, self.seed = count, seed
        self._epoch, self._order = None, []

    def __call__(self, index: int) -> int:
        """The item that global index ``index`` visits."""
        epoch, position = divmod(index, self.count)
        if epoch != self._epoch:
            generator = sample_generator(self.seed, epoch, STREAM_SHUFFLE)
            self._epoch, self._order = epoch, torch.randperm(self.count, generator=generator).tolist()
        return self._order[position]
