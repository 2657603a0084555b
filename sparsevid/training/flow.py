"""Rectified flow: noisy clips x_t = (1 - t) x0 + t * noise, and the velocity target noise - x0."""
from __future__ import annotations

import torch


def shift_t(t: torch.Tensor, shift: float) -> torch.Tensor:
    """Warp noise levels towards 1 (``shift`` > 1) as flow-matching schedulers do: s t / (1 + (s - 1) t)."""
    return shift * t / (1 + (shift - 1) * t)


def unshift_t(t: torch.Tensor, shift: float) -> torch.Tensor:
    """The inverse of :func:`shift_t`: t / (s - (s - 1) t)."""
    return t / (shift - (shift - 1) * t)


FULL_RANGE = (0.0, 1.0)


def check_noise_range(noise_range) -> None:
    """ValueError unless ``noise_range`` is a tuple (low, high) of noise levels with 0 <= low < high <= 1."""
    if (not isinstance(noise_range, tuple) or len(noise_range) != 2
            or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in noise_range)
            or not 0 <= noise_range[0] < noise_range[1] <= 1):
        raise ValueError(f"noise_range must be a tuple (low, high) with 0 <= low < high <= 1, got {noise_range!r}")


def sample_t(batch: int, generator: torch.Generator | None = None, device: torch.device | str = "cpu",
             shift: float = 1.0, logit_std: float = 1.0, noise_range: tuple[float, float] = FULL_RANGE) -> torch.Tensor:
    """Noise levels float32 [batch] in (0, 1): logit-normal (mean 0, ``logit_std``), then shifted. ``noise_range``
    (low, high): the same distribution restricted to [low, high] (e.g. the levels one expert of a two-expert
    pipeline serves), drawn exactly by inverting its normal CDF between the bounds."""
    if shift <= 0:
        raise ValueError(f"shift must be positive, got {shift}")
    check_noise_range(noise_range)
    low, high = noise_range
    if noise_range == FULL_RANGE:
        z = torch.randn(batch, generator=generator)
    else:
        bounds = torch.special.ndtr(torch.logit(unshift_t(torch.tensor([low, high], dtype=torch.float64), shift))
                                    / logit_std)
        u = bounds[0] + (bounds[1] - bounds[0]) * torch.rand(batch, generator=generator, dtype=torch.float64)
        z = torch.special.ndtri(u).float()
    return shift_t(torch.sigmoid(z * logit_std), shift).to(device)


def noisy(x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """x_t = (1 - t) x0 + t noise for x0, noise [B, ...] and t [B] in [0, 1]."""
    if x0.shape != noise.shape:
        raise ValueError(f"x0 {tuple(x0.shape)} and noise {tuple(noise.shape)} must have the same shape")
    if t.shape != x0.shape[:1]:
        raise ValueError(f"t must have shape [{x0.shape[0]}], got {tuple(t.shape)}")
    tt = t.view(-1, *([1] * (x0.dim() - 1))).to(x0.dtype)
    return (1 - tt) * x0 + tt * noise


def flow_matching_loss(velocity: torch.Tensor, x0: torch.Tensor, noise: torch.Tensor,
                       weight: torch.Tensor | None = None) -> torch.Tensor:
    """The flow-matching loss of a predicted ``velocity`` at x_t = (1 - t) x0 + t noise: its mean squared error
    (float32) against the target ``noise - x0``; all three [B, C, T, H, W]. ``weight``: see
    :func:`weighted_squared_error`."""
    return weighted_squared_error(velocity, noise - x0, weight)


def weighted_squared_error(prediction: torch.Tensor, target: torch.Tensor,
                           weight: torch.Tensor | None = None) -> torch.Tensor:
    """Mean squared error in float32 of ``prediction`` against ``target`` (same shape); with ``weight`` (>= 0,
    broadcastable to them) the weighted mean sum(w e^2) / sum(w)."""
    squared = (prediction.float() - target.float()).square()
    if weight is None:
        return squared.mean()
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
        raise TypeError(f"weight must be a floating tensor or None, got {type(weight).__name__}")
    weight = weight.float().expand_as(squared)
    return (weight * squared).sum() / weight.sum()
