"""Yardsticks without sampling, for any diffusers video transformer of a flow-matching family: its velocity on
fixed held-out (latents, noise, t) triples, the relative error of that velocity against the dense model's, and
its flow-matching loss, per noise-level bin.

Sampling amplifies every small difference chaotically; one forward pass does not. The velocity error is what
velocity distillation optimises and the flow-matching loss what pre-training optimises, so both say directly how
much a sparse setting (or a fine-tuned student) changes the model where it is trained to be right.

Triples are deterministic: sample ``i`` of a latent source (:mod:`sparsevid.training.latents`) with noise and
noise level from ``sample_generator(seed, i, STREAM_NOISE)``. Noise levels are stratified: the triple at position
``p`` lies in bin ``p % bins``, uniform within ``[b / bins, (b + 1) / bins)``.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ..integration import apply_sparse_attention, remove_sparse_attention, set_denoising_step
from ..training.draws import STREAM_NOISE, sample_generator
from ..training.flow import FULL_RANGE, check_noise_range
from ..training.latents import LatentBatch
from ..training.velocity import check_flow_family, predict_velocity

HELDOUT_SEED = 2_718_281  # far from the seeds training draws from (0 and 1 by default)


@dataclass(frozen=True)
class HeldOutSet:
    """Fixed triples: ``samples`` (latents [n, C, T, H, W] and their conditioning, on the CPU), noise like the
    latents, noise levels t float32 [n] in ``noise_range`` (default (0, 1)), their bin int64 [n] (equal shares of
    that range), the bin count, the seed and the source's sample ``indices`` they were read from."""

    samples: LatentBatch
    noise: torch.Tensor
    t: torch.Tensor
    bins: torch.Tensor
    num_bins: int
    seed: int
    indices: tuple[int, ...]
    noise_range: tuple[float, float] = FULL_RANGE

    def __len__(self) -> int:
        return self.t.numel()

    @property
    def bin_edges(self) -> list[float]:
        low, high = self.noise_range
        return [low + (high - low) * b / self.num_bins for b in range(self.num_bins + 1)]

    def describe(self) -> dict:
        return {"triples": len(self), "bins": self.num_bins, "bin_edges": self.bin_edges, "seed": self.seed}


def heldout_set(source, per_bin: int = 8, num_bins: int = 5, seed: int = HELDOUT_SEED,
                indices: Sequence[int] | None = None, noise_range: tuple[float, float] = FULL_RANGE) -> HeldOutSet:
    """``per_bin * num_bins`` triples from a latent ``source``: its samples ``indices`` (default 0, 1, ...; e.g.
    held-out samples the fine-tuning never reads), each with the noise and noise level of its index, the levels
    stratified over ``noise_range`` (low, high), 0 <= low < high <= 1 (e.g. the steps one expert of a two-expert
    pipeline serves)."""
    for name, value in (("per_bin", per_bin), ("num_bins", num_bins)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    check_noise_range(noise_range)
    low, high = noise_range
    n = per_bin * num_bins
    indices = list(range(n)) if indices is None else list(indices)
    if len(indices) != n:
        raise ValueError(f"indices must name per_bin * num_bins = {n} samples, got {len(indices)}")
    samples = source.batch(indices, "cpu")
    noise, t = [], []
    for position, i in enumerate(indices):
        generator = sample_generator(seed, i, STREAM_NOISE)
        t.append(low + (high - low) * (position % num_bins + torch.rand(1, generator=generator)) / num_bins)
        noise.append(torch.randn(samples.latents.shape[1:], generator=generator))
    bins = torch.arange(n) % num_bins
    return HeldOutSet(samples, torch.stack(noise), torch.cat(t).float(), bins, num_bins, seed, tuple(indices),
                      (float(low), float(high)))


@torch.no_grad()
def predict_velocities(transformer: torch.nn.Module, heldout: HeldOutSet, sparse=None,
                       steps: Sequence[int] | None = None, batch_size: int = 8,
                       on_batch: Callable[[], None] | None = None) -> torch.Tensor:
    """``transformer``'s velocity on every triple: float32 [n, C, T, H, W] on the CPU.

    sparse: None (the transformer as it is) or a SparseConfig applied for each forward and removed after.
    steps: the denoising step each triple's forward is pinned to (so that dense steps and schedules act as in
    sampling at that noise level; default step 0 for all); no mask is reused across triples. Triples sharing a
    step are batched (``batch_size`` at most). ``on_batch()`` is called after each forward.
    """
    check_flow_family(transformer)
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    steps = [0] * len(heldout) if steps is None else list(steps)
    if len(steps) != len(heldout):
        raise ValueError(f"steps must give one step per triple ({len(heldout)}), got {len(steps)}")
    device, dtype, precision = _forward_precision(transformer)
    out = torch.empty_like(heldout.noise)
    for step in sorted(set(steps)):
        members = [i for i, s in enumerate(steps) if s == step]
        for start in range(0, len(members), batch_size):
            index = torch.tensor(members[start:start + batch_size])
            x0, noise, t = heldout.samples.latents[index], heldout.noise[index], heldout.t[index]
            x_t = (1 - t.view(-1, 1, 1, 1, 1)) * x0 + t.view(-1, 1, 1, 1, 1) * noise
            batch = heldout.samples.select(index).to(device, dtype)
            args = (x_t.to(device, dtype), t.to(device, dtype), batch)
            if sparse is None:
                with precision:
                    velocity = predict_velocity(transformer, *args)
            else:
                apply_sparse_attention(transformer, sparse)
                try:
                    set_denoising_step(transformer, step)
                    with precision:
                        velocity = predict_velocity(transformer, *args)
                finally:
                    remove_sparse_attention(transformer)
            out[index] = velocity.float().cpu()
            if on_batch is not None:
                on_batch()
    return out


def _forward_precision(transformer: torch.nn.Module):
    """(device, input dtype, autocast context) of an evaluation forward: a model holding half-precision weights
    (loaded in bf16, or a student's float32 master weights over a bf16 base) runs under autocast to that dtype on
    float32 inputs, as its training steps do; a float32 model runs as it is."""
    params = list(transformer.parameters())
    half = {p.dtype for p in params} & {torch.bfloat16, torch.float16}
    if half:
        return params[0].device, torch.float32, torch.autocast(params[0].device.type, dtype=half.pop())
    return params[0].device, params[0].dtype, contextlib.nullcontext()


def _by_bin(values: torch.Tensor, heldout: HeldOutSet) -> dict:
    """{"overall": mean, "per_bin": [mean of each bin]} of per-triple values float64 [n]."""
    return {"overall": float(values.mean()),
            "per_bin": [float(values[heldout.bins == b].mean()) for b in range(heldout.num_bins)]}


def velocity_error(velocity: torch.Tensor, reference: torch.Tensor, heldout: HeldOutSet) -> dict:
    """Relative L2 error ||v - v_ref|| / ||v_ref|| of each triple (float64), averaged per bin and overall.

    velocity, reference: [n, C, T, H, W] from :func:`predict_velocities` on the same ``heldout``."""
    if velocity.shape != reference.shape or velocity.shape[0] != len(heldout):
        raise ValueError(f"velocity {tuple(velocity.shape)} and reference {tuple(reference.shape)} must both be "
                         f"[{len(heldout)}, ...] (one per held-out triple)")
    diff = (velocity.double() - reference.double()).flatten(1).norm(dim=1)
    return _by_bin(diff / reference.double().flatten(1).norm(dim=1), heldout)


def heldout_loss(velocity: torch.Tensor, heldout: HeldOutSet) -> dict:
    """The flow-matching loss of ``velocity`` [n, C, T, H, W] on the triples: mean squared error against the target
    noise - latents (float64) per triple, averaged per bin and overall (the training loss at these noise levels)."""
    latents = heldout.samples.latents
    if velocity.shape != latents.shape:
        raise ValueError(f"velocity must have shape {tuple(latents.shape)}, got {tuple(velocity.shape)}")
    target = heldout.noise.double() - latents.double()
    return _by_bin((velocity.double() - target).pow(2).flatten(1).mean(dim=1), heldout)


def velocity_tracker(transformer: torch.nn.Module, heldout: HeldOutSet) -> Callable[[], dict]:
    """A periodic yardstick for fine-tuning ``transformer`` (:func:`sparsevid.training.distill`'s ``evaluate``):
    its dense velocity on ``heldout`` is taken now, before training changes it; each call returns the relative
    velocity error of the transformer as it is then (sparse attention and all) against it, overall and per
    noise-level bin, and the held-out flow-matching loss."""
    reference = predict_velocities(transformer, heldout)

    def evaluate() -> dict:
        velocity = predict_velocities(transformer, heldout)
        error = velocity_error(velocity, reference, heldout)
        return {"heldout_velocity_error": error["overall"], "heldout_velocity_error_per_bin": error["per_bin"],
                "heldout_loss": heldout_loss(velocity, heldout)["overall"]}

    return evaluate
