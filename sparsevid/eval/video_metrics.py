"""Clip similarity: PSNR and SSIM of generated clips against reference clips.

Clips are float [B, C, T, H, W] with values in [-1, 1] (the models' range); both metrics rescale to
[0, 1] first. SSIM follows Wang et al. (2004): an 11-tap Gaussian window (sigma 1.5), K1 = 0.01,
K2 = 0.03, computed per frame and channel over the valid (unpadded) window positions and averaged.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

SSIM_WINDOW, SSIM_SIGMA, SSIM_K1, SSIM_K2 = 11, 1.5, 0.01, 0.03


def _check_pair(x: torch.Tensor, y: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
        raise TypeError("x and y must be tensors")
    if x.shape != y.shape:
        raise ValueError(f"x {tuple(x.shape)} and y {tuple(y.shape)} must have the same shape")
    if x.dim() != 5:
        raise ValueError(f"clips must be [B, C, T, H, W], got {tuple(x.shape)}")


def psnr(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Peak signal-to-noise ratio in dB per clip, float64 [B] (inf for identical clips)."""
    _check_pair(x, y)
    mse = ((x.double() - y.double()) / 2).pow(2).flatten(1).mean(1)  # in [0, 1] units
    return 10 * torch.log10(1.0 / mse)


def _gaussian_window(size: int, sigma: float, dtype, device) -> torch.Tensor:
    coords = torch.arange(size, dtype=dtype, device=device) - (size - 1) / 2
    g = torch.exp(-coords**2 / (2 * sigma**2))
    return g / g.sum()


def ssim(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Structural similarity per clip, float64 [B]; frames must be at least 11 x 11 pixels."""
    _check_pair(x, y)
    b, c, t, h, w = x.shape
    if min(h, w) < SSIM_WINDOW:
        raise ValueError(f"frames must be at least {SSIM_WINDOW}x{SSIM_WINDOW} for SSIM, got {h}x{w}")
    # Frames as a batch of single-channel images in [0, 1].
    a = ((x.double() + 1) / 2).reshape(b * c * t, 1, h, w)
    bb = ((y.double() + 1) / 2).reshape(b * c * t, 1, h, w)
    g = _gaussian_window(SSIM_WINDOW, SSIM_SIGMA, torch.float64, x.device)

    def blur(img):  # separable Gaussian filter, valid positions only
        return F.conv2d(F.conv2d(img, g.view(1, 1, 1, -1)), g.view(1, 1, -1, 1))

    mu_a, mu_b = blur(a), blur(bb)
    var_a = blur(a * a) - mu_a**2
    var_b = blur(bb * bb) - mu_b**2
    cov = blur(a * bb) - mu_a * mu_b
    c1, c2 = SSIM_K1**2, SSIM_K2**2
    ssim_map = ((2 * mu_a * mu_b + c1) * (2 * cov + c2)) / ((mu_a**2 + mu_b**2 + c1) * (var_a + var_b + c2))
    return ssim_map.reshape(b, -1).mean(1)


def clip_similarity(x: torch.Tensor, y: torch.Tensor) -> dict[str, list[float]]:
    """{"psnr": [...], "ssim": [...]} per clip of x against reference y (both [B, C, T, H, W] in [-1, 1])."""
    return {"psnr": psnr(x, y).tolist(), "ssim": ssim(x, y).tolist()}
