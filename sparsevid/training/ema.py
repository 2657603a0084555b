"""Exponential moving average of model weights."""
from __future__ import annotations

import torch


class EMA:
    """Float32 shadow copies of a model's floating-point state, updated with a warm-up decay.

    The decay used at update ``n`` is ``min(decay, (1 + n) / (10 + n))`` so early weights fade quickly.
    """

    def __init__(self, model: torch.nn.Module, decay: float = 0.999):
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {decay}")
        self.decay = decay
        self.updates = 0
        self.shadow = {k: v.detach().float().clone() for k, v in model.state_dict().items() if v.is_floating_point()}

    @torch.no_grad()
    def update(self, model: torch.nn.Module) -> None:
        self.updates += 1
        decay = min(self.decay, (1 + self.updates) / (10 + self.updates))
        state = model.state_dict()
        names = list(self.shadow)
        torch._foreach_lerp_([self.shadow[k] for k in names], [state[k].detach().float() for k in names], 1 - decay)

    @torch.no_grad()
    def copy_to(self, model: torch.nn.Module) -> None:
        """Load the averaged weights into ``model`` (other state entries are left alone)."""
        model.load_state_dict(self.shadow, strict=False)
