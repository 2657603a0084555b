"""Yardsticks without sampling: a model's velocity on fixed held-out (clip, noise, t) triples, its relative
error against a reference model's velocity and its flow-matching loss, per noise-level bin.

Sampling amplifies every small difference chaotically (two dense runs through different attention kernels
already differ by tens of dB of PSNR); one forward pass does not. The velocity error is what velocity
distillation optimises, and the flow-matching loss is what pre-training optimises, so both say directly how
much a sparse configuration (or a fine-tuned student) changes the model where it is trained to be right.

Triples are deterministic from a seed: clip ``i`` is drawn by the model's own data generator (``model.data``,
so a model trained on textured or panning backgrounds is evaluated on them) from
``sample_generator(seed, i, STREAM_DATA)``, its noise and noise level from ``sample_generator(seed, i,
STREAM_NOISE)``. Noise levels are stratified: triple ``i`` lies in bin ``i % bins``, uniform within
``[b / bins, (b + 1) / bins)``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

# Seed of the held-out clips: far from the seeds training uses (pre-training draws from a sequential generator
# seeded with --seed, 0 by default; distillation from sample_generator(--data-seed, i, ...), 1 by default).
HELDOUT_SEED = 2_718_281


@dataclass(frozen=True)
class HeldOutSet:
    """Fixed triples: clips, noise float32 [n, 3, T, H, W] (CPU), noise levels t float32 [n] in (0, 1),
    their bin int64 [n], the clips' captions and the bin count."""

    clips: torch.Tensor
    noise: torch.Tensor
    t: torch.Tensor
    bins: torch.Tensor
    captions: list[str]
    num_bins: int
    seed: int

    def __len__(self) -> int:
        return self.t.numel()

    @property
    def bin_edges(self) -> list[float]:
        return [b / self.num_bins for b in range(self.num_bins + 1)]

    def describe(self) -> dict:
        return {"triples": len(self), "bins": self.num_bins, "bin_edges": self.bin_edges, "seed": self.seed}


def heldout_set(data, per_bin: int = 8, num_bins: int = 5, seed: int = HELDOUT_SEED, exclude=None) -> HeldOutSet:
    """``per_bin * num_bins`` triples from ``data`` (a :class:`~sparsevid.data.ProceduralVideos`). ``exclude``
    (e.g. a fine-tuning slice, a ProceduralVideos): skip the clips whose caption it could draw
    (``exclude.fits``); triples keep the index of their clip, so the set without ``exclude`` is unchanged."""
    from ..data.sources import STREAM_NOISE, ProceduralSource, sample_generator

    for name, value in (("per_bin", per_bin), ("num_bins", num_bins)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    n = per_bin * num_bins
    source = ProceduralSource(data, seed=seed)
    indices = list(range(n)) if exclude is None else _indices_outside(source, exclude, n)
    clips, captions = source.clips(indices)
    noise, t = [], []
    for position, i in enumerate(indices):
        generator = sample_generator(seed, i, STREAM_NOISE)
        t.append((position % num_bins + torch.rand(1, generator=generator)) / num_bins)
        noise.append(torch.randn(clips.shape[1:], generator=generator))
    bins = torch.arange(n) % num_bins
    return HeldOutSet(clips.float().cpu(), torch.stack(noise), torch.cat(t).float(), bins, captions, num_bins, seed)


def _indices_outside(source, exclude, count: int) -> list[int]:
    """The first ``count`` clip indices of ``source`` whose caption ``exclude`` cannot draw."""
    indices, start = [], 0
    while len(indices) < count:
        if start > 1000 * count:
            raise ValueError("exclude could draw (nearly) every caption of data: no held-out clips left")
        batch = list(range(start, start + 4 * count))
        indices += [i for i, c in zip(batch, source.captions(batch)) if not exclude.fits(c)]
        start += len(batch)
    return indices[:count]


def sampler_steps(model, t: torch.Tensor) -> list[int]:
    """For noise levels ``t`` [n], the step of the model's default sampler whose noise level is nearest each
    (the step a sparse configuration's schedule sees at that noise level)."""
    from ..model.sampling import make_scheduler

    sampling = model.config["sampling"]
    scheduler = make_scheduler(sampling.get("scheduler", "euler"), sampling["shift"])
    scheduler.set_timesteps(sampling["steps"])
    levels = scheduler.timesteps.double().cpu() / 1000.0
    return (levels.view(1, -1) - t.double().view(-1, 1)).abs().argmin(dim=1).tolist()


@torch.no_grad()
def predict_velocities(model, heldout: HeldOutSet, config=None, batch_size: int = 8,
                       on_batch: Callable[[], None] | None = None) -> torch.Tensor:
    """The model's caption-conditioned velocity on every triple: float32 [n, 3, T, H, W] on the CPU.

    config: None (the model as it is) or a SparseConfig applied for each forward and removed after; each
    forward is a fresh generation pinned to the sampler step nearest its noise level (:func:`sampler_steps`), so
    dense steps and schedules act as in sampling and no mask is reused across clips. Triples sharing a step
    are batched (``batch_size`` at most). ``on_batch()`` is called after each forward.
    """
    from sparsevid.integration import apply_sparse_attention, remove_sparse_attention, set_denoising_step

    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    param = next(model.parameters())
    steps = sampler_steps(model, heldout.t) if config is not None else [0] * len(heldout)
    out = torch.empty_like(heldout.noise)
    for step in sorted(set(steps)):
        members = [i for i, s in enumerate(steps) if s == step]
        for start in range(0, len(members), batch_size):
            index = torch.tensor(members[start:start + batch_size])
            x0, noise, t = heldout.clips[index], heldout.noise[index], heldout.t[index]
            x_t = (1 - t.view(-1, 1, 1, 1, 1)) * x0 + t.view(-1, 1, 1, 1, 1) * noise
            tokens = model.tokenize([heldout.captions[i] for i in index.tolist()]).to(param.device)
            args = (x_t.to(param.device, param.dtype), t.to(param.device, param.dtype), tokens)
            if config is None:
                velocity = model(*args)
            else:
                apply_sparse_attention(model.transformer, config)
                try:
                    set_denoising_step(model.transformer, step)
                    velocity = model(*args)
                finally:
                    remove_sparse_attention(model.transformer)
            out[index] = velocity.float().cpu()
            if on_batch is not None:
                on_batch()
    return out


def _by_bin(values: torch.Tensor, heldout: HeldOutSet) -> dict:
    """{"overall": mean, "per_bin": [mean of each bin]} of per-triple values float64 [n]."""
    return {"overall": float(values.mean()),
            "per_bin": [float(values[heldout.bins == b].mean()) for b in range(heldout.num_bins)]}


def velocity_error(velocity: torch.Tensor, reference: torch.Tensor, heldout: HeldOutSet) -> dict:
    """Relative L2 error ||v - v_ref|| / ||v_ref|| of each triple (float64), averaged per bin and overall.

    velocity, reference: [n, 3, T, H, W] from :func:`predict_velocities` on the same ``heldout``."""
    if velocity.shape != reference.shape or velocity.shape[0] != len(heldout):
        raise ValueError(f"velocity {tuple(velocity.shape)} and reference {tuple(reference.shape)} must both be "
                         f"[{len(heldout)}, ...] (one per held-out triple)")
    diff = (velocity.double() - reference.double()).flatten(1).norm(dim=1)
    return _by_bin(diff / reference.double().flatten(1).norm(dim=1), heldout)


def flow_matching_loss(velocity: torch.Tensor, heldout: HeldOutSet) -> dict:
    """Mean squared error of ``velocity`` [n, 3, T, H, W] against the target noise - clip (float64), per
    triple, averaged per bin and overall (the training loss at these noise levels)."""
    if velocity.shape != heldout.clips.shape:
        raise ValueError(f"velocity must have shape {tuple(heldout.clips.shape)}, got {tuple(velocity.shape)}")
    target = heldout.noise.double() - heldout.clips.double()
    return _by_bin((velocity.double() - target).pow(2).flatten(1).mean(dim=1), heldout)
