"""A small cache of clips sampled from the (dense) teacher, as distillation data that matches the
teacher's own distribution. The cache is a directory of clip files (:mod:`sparsevid_lab.data.clipfiles`)
plus ``cache.json``; a cache with the same settings is reused."""
from __future__ import annotations

import json
from pathlib import Path

from sparsevid.training import STREAM_TEACHER, barrier, is_main_process, sample_seed, write_text_atomic

from .clipfiles import list_clip_files, write_clip
from .sources import DirectorySource, ProceduralSource

MANIFEST = "cache.json"


def teacher_cache(model, directory: str | Path, count: int, seed: int = 0, steps: int | None = None,
                  guidance: float | None = None, batch_size: int = 8, rank: int = 0, world_size: int = 1,
                  progress: bool = False) -> DirectorySource:
    """Sample ``count`` clips from ``model`` (a dense :class:`~sparsevid_lab.model.builtin.BuiltinVideoDiT`) into
    ``directory`` and return them as a :class:`DirectorySource`.

    Clip ``i`` has the caption of procedural clip ``i`` (seed ``seed``) and its own initial-noise seed; the
    sampler settings default to the model's. In a data-parallel job rank ``r`` samples clips ``i % world_size
    == r`` and all ranks wait for each other. Returns at once when ``directory`` holds a cache of the same
    settings.
    """
    from ..model.sampling import generate

    for name, value in (("count", count), ("batch_size", batch_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    directory = Path(directory)
    settings = {"count": count, "seed": seed, "steps": steps, "guidance": guidance,
                "clip_shape": list(model.clip_shape)}
    manifest = directory / MANIFEST
    if not (manifest.is_file() and json.loads(manifest.read_text()) == settings):
        if is_main_process():
            manifest.unlink(missing_ok=True)
        captions = ProceduralSource(model.data, seed)
        mine = list(range(rank, count, world_size))
        for start in range(0, len(mine), batch_size):
            indices = mine[start:start + batch_size]
            seeds = [sample_seed(seed, i, STREAM_TEACHER) % 2**31 for i in indices]
            texts = captions.captions(indices)
            videos = generate(model, texts, seeds, steps=steps, guidance=guidance, progress=progress)
            for index, video, caption in zip(indices, videos, texts):
                write_clip(directory / f"clip_{index:06d}.safetensors", video, caption)
        barrier()
        if is_main_process():
            stale = [p for p in list_clip_files(directory)
                     if p.name.startswith("clip_") and p.name >= f"clip_{count:06d}"]
            for path in stale:
                path.unlink()
            write_text_atomic(json.dumps(settings, indent=2), manifest)
        barrier()
    return DirectorySource(directory, seed)
