"""Fine-tuning data addressed by global sample index, so every rank of a data-parallel job (and a resumed
run) draws exactly the clips, noise and noise levels the index names, whatever the world size.

A source returns clips for a list of indices: ``clips(indices, device) -> (video float32 [B, C, T, H, W],
captions list[str])``, and has ``clip_shape`` (C, T, H, W) and ``describe()`` (a JSON-able dict).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Sequence

import torch

from sparsevid.training import STREAM_DATA, EpochOrder, check_indices, sample_generator

from .clipfiles import list_clip_files, read_clip


class ProceduralSource:
    """Procedural clips (:class:`~sparsevid_lab.data.ProceduralVideos`), clip ``i`` drawn from its own seed.

    ``seed`` makes the stream differ from pre-training (which drew batches from one sequential generator).
    ``clips``: a fixed set of that many distinct clips (index ``i`` shows clip ``i % clips``, as epochs over a
    finite data set would); None draws a new clip for every index.
    """

    def __init__(self, data, seed: int = 0, clips: int | None = None):
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise TypeError(f"seed must be an int, got {seed!r}")
        if clips is not None and (not isinstance(clips, int) or isinstance(clips, bool) or clips < 1):
            raise ValueError(f"clips must be None or a positive int, got {clips!r}")
        self.data, self.seed, self.distinct = data, seed, clips
        self.clip_shape = (3, data.frames, data.height, data.width)

    def captions(self, indices: Sequence[int]) -> list[str]:
        """The captions of clips ``indices`` (without rendering them)."""
        return self._scenes(indices).captions()

    def clips(self, indices: Sequence[int], device: torch.device | str = "cpu"):
        scenes = self._scenes(indices)
        return self.data.render(scenes, device), scenes.captions()

    def _scenes(self, indices: Sequence[int]):
        check_indices(indices)
        if self.distinct is not None:
            indices = [i % self.distinct for i in indices]
        parts = [self.data.sample_scenes(1, sample_generator(self.seed, i, STREAM_DATA)) for i in indices]
        fields = [f.name for f in dataclasses.fields(parts[0])]  # optional fields are None in every part or none
        return type(parts[0])(**{name: None if getattr(parts[0], name) is None
                                 else torch.cat([getattr(p, name) for p in parts]) for name in fields})

    def describe(self) -> dict:
        clips = {} if self.distinct is None else {"clips": self.distinct}
        return {"kind": "procedural", "seed": self.seed, **clips, **self.data.config()}


class DirectorySource:
    """Clip files in a directory (format: :mod:`sparsevid_lab.data.clipfiles`), visited in a fresh random
    order every epoch: index ``i`` is position ``i % n`` of epoch ``i // n``'s permutation."""

    def __init__(self, directory: str | Path, seed: int = 0):
        self.directory = Path(directory)
        self.files = list_clip_files(self.directory)
        self.seed = seed
        first, _ = read_clip(self.files[0])
        self.clip_shape = tuple(first.shape)
        self.order = EpochOrder(len(self.files), seed)

    def __len__(self) -> int:
        return len(self.files)

    def file(self, index: int) -> Path:
        """The file that sample ``index`` reads."""
        return self.files[self.order(index)]

    def clips(self, indices: Sequence[int], device: torch.device | str = "cpu"):
        check_indices(indices)
        videos, captions = [], []
        for index in indices:
            path = self.file(index)
            video, caption = read_clip(path)
            if tuple(video.shape) != self.clip_shape:
                raise ValueError(f"{path}: clip shape {tuple(video.shape)} differs from {self.clip_shape} "
                                 f"(of {self.files[0].name}); all clips of a directory must have one shape")
            videos.append(video)
            captions.append(caption)
        return torch.stack(videos).to(device), captions

    def describe(self) -> dict:
        # the folder's name, not its path: a record names no folder of the machine it was made on
        return {"kind": "directory", "directory": self.directory.name, "files": len(self.files), "seed": self.seed}
