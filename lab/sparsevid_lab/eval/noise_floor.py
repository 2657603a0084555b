"""The noise floor of clip similarity: dense sampling against dense sampling through another attention path.

Sampling turns tiny numerical differences into visible ones: the same dense model sampled through the
block-sparse kernel with every tile kept (:data:`EVERY_TILE`: mathematically dense attention, but other
kernels, another summation order and the 3D-tiled token order) does not reproduce the clips of its own
SDPA run bit for bit, and the difference grows over the denoising steps. The PSNR / SSIM of those clips
against the dense ones is therefore the best that any sparse configuration can be expected to reach: a
configuration at the noise floor is as close to dense as dense is to itself.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

EVERY_TILE_LABEL = "every tile kept"


def every_tile_config():
    """A SparseConfig that keeps every tile (top-k with topk = 1.0) through the block-sparse path."""
    from sparsevid.plan import SparseConfig

    return SparseConfig(rule="topk", topk=1.0)


def noise_floor(model, jobs: Sequence[tuple[str, int]], dense: torch.Tensor, steps: int, guidance: float | None,
                on_clip: Callable[[], None] | None = None) -> tuple[dict, torch.Tensor]:
    """Sample every (caption, seed) of ``jobs`` with :func:`every_tile_config` and compare with ``dense``
    (float32 [len(jobs), 3, T, H, W], the dense clips of the same jobs).

    Returns ({"config", "sparsity", "seconds", "psnr", "ssim", "psnr_per_clip", "ssim_per_clip", ...}, the clips).
    """
    from .harness import sample_with_stats, summarize_calls
    from sparsevid.eval.video_metrics import psnr, ssim

    config = every_tile_config()
    clips, seconds, calls = sample_with_stats(model, config, jobs, steps, guidance, on_clip=on_clip)
    p, s = psnr(clips, dense), ssim(clips, dense)
    return {"config": config.to_dict(), **summarize_calls(calls), "seconds": seconds, "psnr": float(p.mean()),
            "ssim": float(s.mean()), "psnr_per_clip": p.tolist(), "ssim_per_clip": s.tolist()}, clips
