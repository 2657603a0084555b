"""Sampling clips from the built-in model with a diffusers flow-matching scheduler and classifier-free guidance."""
from __future__ import annotations

from typing import Callable, Sequence

import torch


SCHEDULERS = ("euler", "unipc")


def make_scheduler(name: str, shift: float):
    """A diffusers flow-matching scheduler: "euler" (FlowMatchEulerDiscrete) or "unipc" (UniPC, 2nd order,
    flow sigmas), both with time ``shift``."""
    if name == "euler":
        from diffusers import FlowMatchEulerDiscreteScheduler

        return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=shift)
    if name == "unipc":
        from diffusers import UniPCMultistepScheduler

        return UniPCMultistepScheduler(num_train_timesteps=1000, prediction_type="flow_prediction",
                                       use_flow_sigmas=True, flow_shift=shift)
    raise ValueError(f"scheduler must be one of {SCHEDULERS}, got {name!r}")


def initial_noise(shape: Sequence[int], seeds: Sequence[int]) -> torch.Tensor:
    """float32 [len(seeds), *shape]: one standard-normal clip per seed, drawn on the CPU (device-independent)."""
    if not seeds:
        raise ValueError("seeds must not be empty")
    return torch.stack([torch.randn(*shape, generator=torch.Generator().manual_seed(int(s))) for s in seeds])


@torch.no_grad()
def generate(model, captions: Sequence[str], seeds: Sequence[int], steps: int | None = None,
             guidance: float | None = None, shift: float | None = None, scheduler: str | None = None,
             on_step: Callable[[int, float], None] | None = None, progress: bool | str = False) -> torch.Tensor:
    """Clips for ``captions`` from the noise of ``seeds``: float32 [B, 3, T, H, W] in [-1, 1] on the CPU.

    model: a :class:`~sparsevid_lab.model.builtin.BuiltinVideoDiT` (its device and dtype are used).
    steps, guidance, shift, scheduler: sampler steps, CFG scale (1 = no guidance), the time shift and
    the scheduler (see :func:`make_scheduler`); None takes the model config's ``sampling`` defaults.
    ``on_step(i, t)`` is called before step ``i`` runs the model at noise level ``t`` in [0, 1].
    ``progress``: show a progress bar over the denoising steps (a string names the bar).
    """
    from tqdm.auto import tqdm

    if isinstance(captions, str):
        raise TypeError("captions must be a sequence of strings, not a single string")
    if len(captions) != len(seeds):
        raise ValueError(f"captions ({len(captions)}) and seeds ({len(seeds)}) must have the same length")
    defaults = model.config["sampling"]
    steps = defaults["steps"] if steps is None else steps
    guidance = defaults["guidance"] if guidance is None else guidance
    shift = defaults["shift"] if shift is None else shift
    scheduler = defaults.get("scheduler", "euler") if scheduler is None else scheduler
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive int, got {steps!r}")
    if guidance < 1:
        raise ValueError(f"guidance must be >= 1, got {guidance}")
    param = next(model.parameters())
    device, dtype = param.device, param.dtype
    scheduler = make_scheduler(scheduler, shift)
    scheduler.set_timesteps(steps, device=device)
    x = initial_noise(model.clip_shape, seeds).to(device)
    tokens = model.tokenize(list(captions)).to(device)
    if guidance != 1:
        tokens = torch.cat([model.tokenize([""] * len(captions)).to(device), tokens])
    for i, timestep in enumerate(tqdm(scheduler.timesteps, desc=progress if isinstance(progress, str) else "sampling",
                                         unit="step", disable=not progress, leave=False)):
        t = float(timestep) / 1000.0
        if on_step is not None:
            on_step(i, t)
        model_in = torch.cat([x, x]) if guidance != 1 else x
        t_in = torch.full((model_in.shape[0],), t, device=device, dtype=dtype)
        velocity = model(model_in.to(dtype), t_in, tokens).float()
        if guidance != 1:
            uncond, cond = velocity.chunk(2)
            velocity = uncond + guidance * (cond - uncond)
        x = scheduler.step(velocity, timestep, x, return_dict=False)[0]
    return x.clamp(-1, 1).cpu()
