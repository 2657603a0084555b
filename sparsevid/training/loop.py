"""A reusable training loop: AdamW, warm-up + cosine learning rate, bf16 autocast, gradient clipping,
EMA, time or step budget, atomic checkpoints. The objective is a callable, so other losses
(e.g. distillation) reuse the loop unchanged."""
from __future__ import annotations

import math
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from .checkpoint import load_training_state, save_training_state
from .ema import EMA


@dataclass
class LoopConfig:
    """Optimiser and budget settings. Training stops at ``max_steps`` or after ``max_seconds``,
    whichever comes first (at least one must be set); the cosine decay follows whichever budget is
    closer to being used up."""

    lr: float = 4e-4
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.99)
    warmup_steps: int = 200
    grad_clip: float = 1.0
    ema_decay: float = 0.999
    max_steps: int | None = None
    max_seconds: float | None = None
    bf16: bool = True
    log_every: int = 25
    checkpoint_every: int = 500

    def __post_init__(self) -> None:
        if self.max_steps is None and self.max_seconds is None:
            raise ValueError("set max_steps or max_seconds")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"max_steps must be positive, got {self.max_steps}")
        if self.max_seconds is not None and self.max_seconds <= 0:
            raise ValueError(f"max_seconds must be positive, got {self.max_seconds}")
        if self.lr <= 0 or not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"need lr > 0 and min_lr_ratio in [0, 1], got {self.lr}, {self.min_lr_ratio}")
        if self.warmup_steps < 0 or self.grad_clip <= 0 or self.log_every < 1 or self.checkpoint_every < 1:
            raise ValueError("warmup_steps must be >= 0; grad_clip, log_every and checkpoint_every positive")


@dataclass
class TrainResult:
    steps: int
    seconds: float
    history: list[dict] = field(default_factory=list)
    ema: EMA | None = None


def learning_rate(config: LoopConfig, step: int, elapsed: float) -> float:
    """Linear warm-up over ``warmup_steps``, then cosine decay to ``min_lr_ratio * lr`` over the budget."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    progress = 0.0
    if config.max_steps is not None:
        progress = max(progress, step / config.max_steps)
    if config.max_seconds is not None:
        progress = max(progress, elapsed / config.max_seconds)
    cosine = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return config.lr * (config.min_lr_ratio + (1 - config.min_lr_ratio) * cosine)


def train_loop(model: torch.nn.Module, loss_fn: Callable[[int], torch.Tensor], config: LoopConfig,
               state_path: str | Path | None = None, resume: bool = False,
               log: Callable[[str], None] = print) -> TrainResult:
    """Minimise ``loss_fn(step)`` (a scalar; it draws its own batch) over ``model``'s parameters.

    Writes the full training state (weights, EMA, optimiser) to ``state_path`` every
    ``checkpoint_every`` steps and at the end; with ``resume`` it starts from that file if present.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    device_type = params[0].device.type
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": config.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=config.lr, betas=config.betas, fused=device_type == "cuda")
    ema = EMA(model, config.ema_decay)
    step = 0
    if resume and state_path is not None and Path(state_path).is_file():
        step, _ = load_training_state(state_path, model, ema.shadow, optimizer)
        ema.updates = step
        log(f"resumed from {state_path} at step {step}")
    autocast = (torch.autocast(device_type, dtype=torch.bfloat16) if config.bf16 and device_type == "cuda"
                else nullcontext())
    history: list[dict] = []
    window: list[torch.Tensor] = []
    start = time.perf_counter()
    model.train()
    first_step = step
    while True:
        elapsed = time.perf_counter() - start
        if (config.max_steps is not None and step >= config.max_steps) or \
                (config.max_seconds is not None and elapsed >= config.max_seconds):
            break
        lr = learning_rate(config, step, elapsed)
        for group in optimizer.param_groups:
            group["lr"] = lr
        with autocast:
            loss = loss_fn(step)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, config.grad_clip)
        optimizer.step()
        ema.update(model)
        window.append(loss.detach())
        step += 1
        if step % config.log_every == 0 or step == first_step + 1:
            mean = float(torch.stack(window).mean())
            window.clear()
            if not math.isfinite(mean):
                raise FloatingPointError(f"mean loss became {mean} by step {step}")
            row = {"step": step, "loss": mean, "lr": lr, "grad_norm": float(grad_norm),
                   "seconds": round(time.perf_counter() - start, 2)}
            history.append(row)
            log(f"step {step:6d}  loss {mean:.4f}  lr {lr:.2e}  grad {row['grad_norm']:.3f}  {row['seconds']:.0f}s")
        if state_path is not None and step % config.checkpoint_every == 0:
            save_training_state(state_path, model, ema.shadow, optimizer, step)
    if window:
        history.append({"step": step, "loss": float(torch.stack(window).mean()), "lr": lr,
                        "grad_norm": float(grad_norm), "seconds": round(time.perf_counter() - start, 2)})
    if state_path is not None and step > first_step:
        save_training_state(state_path, model, ema.shadow, optimizer, step)
    model.eval()
    return TrainResult(steps=step, seconds=time.perf_counter() - start, history=history, ema=ema)
