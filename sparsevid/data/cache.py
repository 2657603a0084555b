"""Caching a diffusers video pipeline's training inputs: videos with captions (or clips sampled from the pipeline
itself) encoded by the pipeline's own VAE and text encoder into a shard folder (:class:`~sparsevid.training.
latents.ShardWriter`) that :class:`~sparsevid.training.LatentDirectory` and ``sparsevid distill --data`` read.

A run is resumable: it continues a folder written with the same settings, encoding only the items not in it
yet. An item that cannot become a sample (it does not decode, is too short or too small, has no caption) is
reported with its reason, listed under ``skipped`` in the index, and left out; nothing written is lost.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from ..training.draws import STREAM_TEACHER, sample_generator
from ..training.latents import NULL_FILE, ShardWriter, write_null_text
from .families import Family, family_for
from .videos import UnusableItem, VideoItem, fit, read_clip


class Encoder:
    """A diffusers video pipeline with its family: videos and prompts to the inputs of its transformer.

    ``spatial``: input pixels per token side (the VAE's spatial factor ``vae_spatial`` times the transformer's patch);
    ``temporal``: the VAE's frame compression (a clip has ``k * temporal + 1`` frames). A pipeline of a model that
    works in pixel space says so with both VAE factors 1.
    """

    def __init__(self, pipe, family: Family, transformer_config: dict, source: str):
        self.pipe, self.family, self.source = pipe, family, source
        self.device, self.dtype = torch.device(pipe.device), pipe.dtype
        self.temporal, self.vae_spatial = family.compression(pipe)
        self.spatial = self.vae_spatial * family.patch(transformer_config)

    def frames(self, available: int) -> int:
        """The longest clip length the VAE takes within ``available`` frames (0 when none)."""
        return (available - 1) // self.temporal * self.temporal + 1 if available >= 1 else 0

    def size(self, height: int, width: int) -> tuple[int, int]:
        """The largest (height, width) within (``height``, ``width``) that the VAE and the patching take."""
        return height // self.spatial * self.spatial, width // self.spatial * self.spatial

    def check(self, height: int | None, width: int | None, frames: int | None) -> None:
        """ValueError naming the option when a requested size or length does not suit the model."""
        for name, value in (("height", height), ("width", width)):
            if value is not None and (value < self.spatial or value % self.spatial):
                raise ValueError(f"--{name} {value}: must be a positive multiple of {self.spatial} for this "
                                 f"pipeline (VAE factor x patch size)")
        if frames is not None and (frames < 1 or self.frames(frames) != frames):
            raise ValueError(f"--frames {frames}: must be k * {self.temporal} + 1 for this pipeline's VAE "
                             f"(e.g. {self.frames(frames) or 1})")

    @torch.no_grad()
    def latents(self, video: torch.Tensor) -> torch.Tensor:
        """The transformer's latents float32 [C, T, H / s, W / s] of ``video`` float [F, 3, H, W] in [-1, 1]:
        the mean of the VAE's posterior, normalised as the pipeline does."""
        vae = self.pipe.vae
        pixels = video.permute(1, 0, 2, 3).unsqueeze(0).to(self.device, vae.dtype)
        posterior = vae.encode(pixels).latent_dist
        return self.family.normalise(vae, posterior.mode().float())[0].cpu()

    @torch.no_grad()
    def prompt(self, text: str) -> tuple[torch.Tensor, torch.Tensor | None, int, dict[str, torch.Tensor]]:
        """(text states [L, D] as the pipeline gives its transformer, text mask [L] or None, token count, further
        transformer inputs {argument: tensor [...]} of the prompt)."""
        states, mask, tokens, *extra = self.family.encode_prompt(self.pipe, [text], self.device)
        extra = {name: value[0].cpu() for name, value in (extra[0] if extra else {}).items()}
        return states[0].cpu(), None if mask is None else mask[0].cpu(), tokens[0], extra

    def conditioning(self, text: str, fps: float | None, guidance: float | None) -> dict:
        """A clip's conditioning (``ShardWriter.add``'s text, text_mask and extra) with its prompt's token count
        (``tokens``): the prompt's inputs and those that the clip's frame rate ``fps`` and guidance scale
        ``guidance`` fix (None: the pipeline's default; :attr:`Family.clip_inputs`)."""
        states, mask, tokens, extra = self.prompt(text)
        if self.family.clip_inputs is not None:
            extra.update(self.family.clip_inputs(self.pipe, fps, guidance))
        return {"text": states, "text_mask": mask, "extra": extra, "tokens": tokens}


def load_encoder(source: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 transformer: bool = False) -> Encoder:
    """The diffusers pipeline at ``source`` (a folder or a hub id; ``from_pretrained``) on ``device``; without
    its transformer unless ``transformer`` (sampling needs it, encoding does not)."""
    import diffusers

    text = str(source)
    if not Path(source).is_dir() and (Path(source).is_absolute() or text.startswith(".") or text.count("/") != 1):
        raise FileNotFoundError(f"--pipeline {text}: no such folder, and not a hub id (owner/name)")
    index = diffusers.DiffusionPipeline.load_config(text)
    family = family_for(index["_class_name"])
    skip = {} if transformer else {name: None for name in ("transformer", "transformer_2") if name in index}
    pipe = diffusers.DiffusionPipeline.from_pretrained(str(source), torch_dtype=dtype, **skip).to(device)
    pipe.set_progress_bar_config(disable=True)
    model_class = getattr(diffusers, index["transformer"][1])
    config = dict(pipe.transformer.config) if transformer else model_class.load_config(str(source),
                                                                                       subfolder="transformer")
    return Encoder(pipe, family, config, str(source))


@dataclass
class CacheReport:
    """One run: samples ``written`` by it, the folder's ``total``, its ``skipped`` items ({source, reason}),
    and the run's time (``clips_per_second``: written clips over the run's seconds)."""

    written: int
    total: int
    skipped: list[dict] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def clips_per_second(self) -> float:
        return self.written / self.seconds if self.seconds > 0 else 0.0


def cache_videos(encoder: Encoder, items: list[VideoItem], out: str | Path, height: int | None = None,
                 width: int | None = None, frames: int | None = None, fps: float | None = None,
                 shard_size: int = 16, progress: bool = True, log: Callable[[str], None] | None = None
                 ) -> CacheReport:
    """Encode ``items`` into the shard folder ``out``.

    Each clip is resampled to ``fps`` (default: its own rate), cut to its first ``frames`` (default: the most the
    VAE takes), scaled and centre-cropped to ``height`` x ``width`` (default: its own size cropped to a multiple
    the model takes; clips of different sizes or lengths land in different buckets).
    """
    encoder.check(height, width, frames)
    if (height is None) != (width is None):
        raise ValueError("give --height and --width together, or neither (each clip keeps its own size)")
    settings = _settings(encoder, "videos", height=height, width=width, frames=frames, fps=fps)

    def sample(item: VideoItem) -> dict:
        if not item.caption:
            raise UnusableItem(f"no caption: put {Path(item.source).stem}.txt beside it or give it a manifest row")
        clip = read_clip(item, fps, frames)
        length = frames or encoder.frames(len(clip.frames))
        if len(clip.frames) < length or length == 0:
            raise UnusableItem(f"{len(clip.frames)} frames{'' if fps is None else f' at {fps} fps'}, "
                               f"needs {length or 1}")
        size = (height, width) if height is not None else encoder.size(*clip.frames.shape[-2:])
        if min(size) == 0:
            raise UnusableItem(f"{tuple(clip.frames.shape[-2:])} pixels, smaller than {encoder.spatial}")
        conditioning = encoder.conditioning(item.caption, clip.fps, None)
        metadata = {"source": item.source, "caption": item.caption, "height": size[0], "width": size[1],
                    "frames": length, "fps": clip.fps, "source_size": list(clip.frames.shape[-2:]),
                    "prompt_tokens": conditioning.pop("tokens")}
        return {"latents": encoder.latents(fit(clip.frames[:length], *size)), **conditioning, "metadata": metadata}

    by_source = {item.source: item for item in items}
    return _fill(encoder, out, settings, list(by_source), lambda sources: [sample(by_source[sources[0]])], 1,
                 shard_size, progress, log)


def cache_synthetic(encoder: Encoder, prompts: list[str], count: int, out: str | Path, height: int, width: int,
                    frames: int, steps: int = 50, guidance: float | None = None, seed: int = 0, shard_size: int = 16,
                    progress: bool = True, log: Callable[[str], None] | None = None,
                    batch_size: int = 1) -> CacheReport:
    """Sample ``count`` clips from the pipeline itself (its own distribution, the dense teacher's) into ``out``:
    clip ``i`` has prompt ``prompts[i % len(prompts)]`` and noise seeded by (``seed``, ``i``), ``steps`` sampling
    steps at guidance ``guidance`` (None: the family's :meth:`~sparsevid.data.families.Family.synthetic_guidance`,
    unguided for classifier-free guidance); the latents are what the sampler ends with (``output_type="latent"``).
    ``batch_size`` clips are sampled per pipeline call (each from its own generator: the clips do not depend on it)."""
    if not prompts:
        raise ValueError("--prompts: no prompts (one per line)")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    if getattr(encoder.pipe, "transformer", None) is None:
        raise ValueError("sampling needs the pipeline's transformer: load_encoder(..., transformer=True)")
    encoder.check(height, width, frames)
    guidance = encoder.family.synthetic_guidance(encoder.pipe) if guidance is None else guidance
    settings = _settings(encoder, "synthetic", height=height, width=width, frames=frames, steps=steps,
                         guidance=guidance, seed=seed)

    def samples(sources: list[str]) -> list[dict]:
        indices = [int(source.split(":")[1]) for source in sources]
        texts = [prompts[i % len(prompts)] for i in indices]
        result = encoder.pipe(prompt=texts, height=height, width=width, num_frames=frames,
                              num_inference_steps=steps, guidance_scale=guidance, output_type="latent",
                              generator=[sample_generator(seed, i, STREAM_TEACHER) for i in indices])
        latents = result.frames
        if encoder.family.unpack is not None:
            grid = ((frames - 1) // encoder.temporal + 1, height // encoder.vae_spatial, width // encoder.vae_spatial)
            latents = encoder.family.unpack(encoder.pipe, latents, grid)
        made = []
        for row, (source, prompt) in enumerate(zip(sources, texts)):
            conditioning = encoder.conditioning(prompt, None, guidance)
            metadata = {"source": source, "caption": prompt, "height": height, "width": width, "frames": frames,
                        "fps": None, "prompt_tokens": conditioning.pop("tokens")}
            made.append({"latents": latents[row].float().cpu(), **conditioning, "metadata": metadata})
        return made

    return _fill(encoder, out, settings, [f"synthetic:{i}" for i in range(count)], samples, batch_size, shard_size,
                 progress, log)


def _settings(encoder: Encoder, mode: str, **options) -> dict:
    """What the folder's samples are made with: a resumed run must use the same."""
    return {"pipeline": encoder.source, "family": encoder.family.name, "mode": mode,
            "text_length": encoder.family.text_length, "dtype": str(encoder.dtype), **options}


def _fill(encoder: Encoder, out: str | Path, settings: dict, sources: list[str],
          make: Callable[[list[str]], list[dict]], batch_size: int, shard_size: int, progress: bool,
          log: Callable[[str], None] | None) -> CacheReport:
    """Make the samples of ``sources`` not yet in ``out``, ``batch_size`` at a time (``make(sources)`` -> one sample
    per source), skipping and reporting an unusable item (``UnusableItem``; ``batch_size`` 1)."""
    from tqdm import tqdm

    start = time.perf_counter()
    writer = ShardWriter(out, settings, shard_size)
    if not (Path(out) / NULL_FILE).is_file():
        text, mask, _, extra = encoder.prompt("")
        write_null_text(out, text, mask, extra)
    done = writer.done
    todo = [source for source in sources if source not in done]
    log = log or tqdm.write
    written = 0
    with writer, tqdm(total=len(sources), initial=len(sources) - len(todo), unit="clip", desc="cache",
                      disable=not progress) as bar:
        for first in range(0, len(todo), batch_size):
            batch = todo[first:first + batch_size]
            try:
                made = make(batch)
            except UnusableItem as reason:
                writer.skip(batch[0], str(reason))
                log(f"skipped {batch[0]}: {reason}")
                made = []
            for sample in made:
                writer.add(**sample)
                written += 1
            bar.update(len(batch))
    return CacheReport(written, writer.count, list(writer.index["skipped"]), time.perf_counter() - start)
