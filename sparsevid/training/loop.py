"""A reusable training loop: AdamW, warm-up + cosine learning rate, bf16 autocast, gradient clipping,
optional EMA, time or step budget, atomic resumable checkpoints, a per-step JSONL log, and data-parallel
training (a ``DistributedDataParallel`` model: every rank runs the loop, rank 0 logs and checkpoints).
The objective is a callable, so the flow-matching and distillation losses share the loop."""
from __future__ import annotations

import json
import math
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from .checkpoint import load_training_state, training_tensors, write_text_atomic, write_training_state
from .distributed import broadcast_float, global_mean, is_main_process, unwrap
from .ema import EMA
from .sharding import is_sharded


OPTIMIZERS = ("adamw", "adamw8bit")


@dataclass
class LoopConfig:
    """Optimiser and budget settings. Training stops at ``max_steps`` or after ``max_seconds``,
    whichever comes first (at least one must be set); the cosine decay follows whichever budget is
    closer to being used up. ``ema_decay`` None trains without EMA; ``progress`` shows a tqdm bar.
    ``stop_at`` (a ``time.time()`` moment) ends the call early, with a checkpoint, when the next step would
    start after it: a budget split over several calls (each resuming) follows the same learning-rate schedule
    as one uninterrupted run. ``accumulation_steps``: each optimiser step sums the gradients of that many
    micro-steps (``loss_fn`` is called with the micro-step index ``step * accumulation_steps + i``).
    ``optimizer``: "adamw" (fused on CUDA) or "adamw8bit" (bitsandbytes, CUDA; optimiser state in 8 bits).
    ``eval_every``: call ``train_loop``'s ``evaluate`` every that many steps (and at the end)."""

    lr: float = 4e-4
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.99)
    warmup_steps: int = 200
    grad_clip: float = 1.0
    ema_decay: float | None = 0.999
    max_steps: int | None = None
    max_seconds: float | None = None
    bf16: bool = True
    log_every: int = 25
    checkpoint_every: int = 500
    progress: bool = False
    stop_at: float | None = None
    accumulation_steps: int = 1
    optimizer: str = "adamw"
    eval_every: int | None = None

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
        if not isinstance(self.accumulation_steps, int) or self.accumulation_steps < 1:
            raise ValueError(f"accumulation_steps must be a positive int, got {self.accumulation_steps!r}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        if self.eval_every is not None and (not isinstance(self.eval_every, int) or self.eval_every < 1):
            raise ValueError(f"eval_every must be None or a positive int, got {self.eval_every!r}")


@dataclass
class TrainResult:
    """``finished``: the budget (``max_steps`` / ``max_seconds``) was used up, not cut short by ``stop_at``."""

    steps: int
    seconds: float
    history: list[dict] = field(default_factory=list)
    ema: EMA | None = None
    finished: bool = True
    evaluations: list[dict] = field(default_factory=list)


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


def make_optimizer(params: list[torch.nn.Parameter], config: LoopConfig) -> torch.optim.Optimizer:
    """AdamW over ``params`` (``config.optimizer``): weight decay on matrices (dim >= 2) only; fused on CUDA, or
    bitsandbytes' 8-bit AdamW (CUDA only)."""
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": config.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    cuda = params[0].device.type == "cuda"
    if config.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=config.lr, betas=config.betas, fused=cuda)
    if not cuda:
        raise ValueError("optimizer='adamw8bit' needs CUDA (bitsandbytes' 8-bit AdamW); use 'adamw' on the CPU")
    try:
        import bitsandbytes
    except ImportError:
        raise ImportError("optimizer='adamw8bit' needs bitsandbytes: pip install bitsandbytes") from None
    return bitsandbytes.optim.AdamW8bit(groups, lr=config.lr, betas=config.betas)


def resume_training(state_path: str | Path, module: torch.nn.Module, ema: EMA | None,
                    optimizer: torch.optim.Optimizer, run_info: dict | None) -> tuple[int, float]:
    """Restore weights, EMA, optimiser and RNG states from ``state_path``: (step, elapsed seconds).

    Raises ValueError when the file was written by a run whose ``run_info`` differs from this one's.
    """
    step, info = load_training_state(state_path, module, {} if ema is None else ema.shadow, optimizer)
    saved = info.get("run", {})
    if run_info is not None and saved != run_info:
        changed = sorted(k for k in set(saved) | set(run_info) if saved.get(k) != run_info.get(k))
        raise ValueError(f"cannot resume from {state_path}: it was written by a run with different "
                         f"settings {changed} (saved {[saved.get(k) for k in changed]}, "
                         f"now {[run_info.get(k) for k in changed]})")
    if ema is not None:
        ema.updates = step
    return step, float(info.get("elapsed", 0.0))


class StepLog:
    """What the loop reports: a row in ``history`` (and a log line or progress bar) every ``log_every`` steps
    and at the first step, and a per-step JSONL row. Losses and gradient norms stay on the device until a
    report needs them (one device read per report, none per step).

    Only the main process writes (``enabled``); every process keeps ``history``. The JSONL file keeps the rows of
    steps up to ``first_step`` (a resumed run's earlier rows) and continues after them.
    """

    def __init__(self, config: LoopConfig, first_step: int, enabled: bool, jsonl_path: str | Path | None,
                 log: Callable[[str], None]):
        self.config, self.first_step, self.enabled, self.log = config, first_step, enabled, log
        if jsonl_path is not None and enabled:
            _truncate_jsonl(Path(jsonl_path), first_step)
        self.history: list[dict] = []
        self._window: list[torch.Tensor] = []
        self._pending: list[tuple] = []  # per-step JSONL rows whose loss / grad norm are still on the device
        self._bar = _progress_bar(config.progress and enabled, config.max_steps, first_step)
        self._jsonl = Path(jsonl_path).open("a") if jsonl_path is not None and enabled else None
        self._last: tuple | None = None  # (step, lr, grad_norm) of the last step

    def step(self, step: int, loss: torch.Tensor, lr: float, grad_norm: torch.Tensor, seconds: float) -> None:
        """Record ``step`` (its mean loss over ranks and gradient norm, device scalars)."""
        self._window.append(loss)
        self._last = (step, lr, grad_norm)
        if self._jsonl is not None:
            self._pending.append((step, loss, lr, grad_norm.detach(), seconds))
        if self._bar is not None:
            self._bar.update(1)
        if step % self.config.log_every == 0 or step == self.first_step + 1:
            self.flush()
            mean = self._close_window()
            if not math.isfinite(mean):
                raise FloatingPointError(f"mean loss became {mean} by step {step}")
            row = _row(step, mean, lr, float(grad_norm), seconds, 2)
            self.history.append(row)
            if self._bar is not None:
                self._bar.set_postfix(loss=f"{mean:.4g}", lr=f"{lr:.2e}")
            elif self.enabled:
                self.log(f"step {step:6d}  loss {mean:.4f}  lr {lr:.2e}  grad {row['grad_norm']:.3f}  "
                         f"{row['seconds']:.0f}s")

    def flush(self) -> None:
        """Write the pending per-step rows to the JSONL log, if there is one (one device read for all)."""
        if self._jsonl is None or not self._pending:
            return
        values = torch.stack([torch.stack([loss.float(), norm.float()]) for _, loss, _, norm, _ in self._pending])
        for (step, _, lr, _, seconds), (loss, norm) in zip(self._pending, values.tolist()):
            self._jsonl.write(json.dumps(_row(step, loss, lr, norm, seconds, 3)) + "\n")
        self._jsonl.flush()
        self._pending.clear()

    def close(self, seconds: float) -> None:
        """Report the steps since the last report as one more history row; write and close the files."""
        if self._window:
            step, lr, grad_norm = self._last
            self.history.append(_row(step, self._close_window(), lr, float(grad_norm), seconds, 2))
        self.flush()
        for handle in (self._bar, self._jsonl):
            if handle is not None:
                handle.close()

    def _close_window(self) -> float:
        mean = float(torch.stack(self._window).mean())
        self._window.clear()
        return mean


class Budget:
    """The step / time budget of a run: when it stops and each step's learning rate. The clock counts the
    seconds of earlier runs (``elapsed_before``, on resume); with a time budget or a ``stop_at`` moment every rank
    follows rank 0's clock (one broadcast per step when distributed), so that all ranks stop together.
    ``finished``: the call ended because the budget was used up (not at ``stop_at``)."""

    def __init__(self, config: LoopConfig, elapsed_before: float, device: torch.device):
        self.config, self.device = config, device
        self.start = time.perf_counter() - elapsed_before
        self.finished = False

    def elapsed(self) -> float:
        """Seconds of training so far (this process's clock)."""
        return time.perf_counter() - self.start

    def learning_rate(self, step: int) -> float | None:
        """The learning rate of ``step`` (the number of steps done), or None when the call ends: the budget is
        used up (``finished``) or the step would start after ``config.stop_at``."""
        config, elapsed = self.config, self.elapsed()
        if config.max_seconds is not None:
            elapsed = broadcast_float(elapsed, self.device)
        if (config.max_steps is not None and step >= config.max_steps) or \
                (config.max_seconds is not None and elapsed >= config.max_seconds):
            self.finished = True
            return None
        if config.stop_at is not None and broadcast_float(time.time(), self.device) >= config.stop_at:
            return None
        return learning_rate(config, step, elapsed)


class Checkpointer:
    """Writes the full training state (weights, EMA, optimiser, step, elapsed seconds, RNG states and
    ``run_info``) to ``path`` (None: never) from the main process, after flushing the per-step log so that the two
    agree on resume. Every rank calls :meth:`save` (gathering a sharded model's state is a collective)."""

    def __init__(self, path: str | Path | None, main: bool, module: torch.nn.Module, ema: EMA | None,
                 optimizer: torch.optim.Optimizer, run_info: dict | None, flush_log: Callable[[], None]):
        self.path, self.main, self.module, self.ema, self.optimizer = path, main, module, ema, optimizer
        self.run_info, self.flush_log = run_info or {}, flush_log

    def save(self, step: int, elapsed: float) -> None:
        self.flush_log()
        if self.path is None or not (self.main or is_sharded(self.module)):  # gathering shards takes every rank
            return
        tensors = training_tensors(self.module, {} if self.ema is None else self.ema.shadow, self.optimizer)
        if self.main:
            write_training_state(self.path, tensors, step, {"elapsed": elapsed, "run": self.run_info})


def optimizer_step(model: torch.nn.Module, loss_fn: Callable[[int], torch.Tensor], step: int,
                   optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], lr: float, grad_clip: float,
                   autocast, accumulation_steps: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimisation step at learning rate ``lr``: the mean loss of ``accumulation_steps`` micro-steps
    (``loss_fn(step * accumulation_steps + i)``, each backpropagated; a data-parallel model synchronises its
    gradients on the last only), gradient clipping, optimiser update. Returns the mean loss and the gradient norm
    before clipping (device scalars: nothing is read on the host)."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)
    total = None
    for micro in range(accumulation_steps):
        last = micro == accumulation_steps - 1
        sync = nullcontext() if last or not hasattr(model, "no_sync") else model.no_sync()
        with sync:
            with autocast:
                loss = loss_fn(step * accumulation_steps + micro) / accumulation_steps
            loss.backward()
        total = loss.detach() if total is None else total + loss.detach()
    grad_norm = torch.nn.utils.clip_grad_norm_(params, grad_clip)
    optimizer.step()
    if hasattr(grad_norm, "full_tensor"):  # a DTensor, from FSDP-sharded gradients
        grad_norm = grad_norm.full_tensor()
    return total, grad_norm


def _autocast(config: LoopConfig, device_type: str):
    """bf16 autocast on CUDA when ``config.bf16``, else nothing."""
    return torch.autocast(device_type, dtype=torch.bfloat16) if config.bf16 and device_type == "cuda" else nullcontext()


def train_loop(model: torch.nn.Module, loss_fn: Callable[[int], torch.Tensor], config: LoopConfig,
               state_path: str | Path | None = None, resume: bool = False,
               log: Callable[[str], None] = print, *, run_info: dict | None = None,
               jsonl_path: str | Path | None = None, evaluate: Callable[[], dict] | None = None,
               eval_jsonl_path: str | Path | None = None) -> TrainResult:
    """Minimise ``loss_fn(step)`` (a scalar; it draws its own batch) over ``model``'s trainable parameters.

    ``model`` may be wrapped in ``DistributedDataParallel`` (``loss_fn`` must call the wrapper); every
    rank then runs this loop and rank 0 alone logs and writes files. Writes the full training state
    (weights, EMA, optimiser, step, elapsed time, RNG states and ``run_info``) to ``state_path`` every
    ``checkpoint_every`` steps and at the end; with ``resume`` it starts from that file if present, after
    checking that its ``run_info`` equals this run's (a run whose data order depends on e.g. the batch
    size cannot continue under another). ``jsonl_path``: one JSON row per step (step, loss averaged over
    ranks, lr, grad_norm, seconds); on resume, rows past the restored step are dropped.
    ``evaluate() -> dict`` (every rank calls it; e.g. a held-out velocity error) runs every ``eval_every`` steps and
    at the end, its rows ({"step", ...}) go to ``TrainResult.evaluations``, the log and ``eval_jsonl_path``.

    The parts, one job each: :func:`make_optimizer`, :func:`resume_training` (resume), :class:`Budget` (when to
    stop, learning rate), :func:`optimizer_step`, :class:`~sparsevid.training.ema.EMA`, :class:`StepLog`
    (logging) and :class:`Checkpointer` (checkpoints). A step reads nothing from the device but what
    ``StepLog`` reports.
    """
    module = unwrap(model)
    params = [p for p in module.parameters() if p.requires_grad]
    if not params:
        raise ValueError("model has no trainable parameters (requires_grad=True)")
    optimizer = make_optimizer(params, config)
    if config.ema_decay is not None and is_sharded(module):
        raise ValueError("an EMA of FSDP-sharded weights is not supported: set ema_decay=None")
    ema = EMA(module, config.ema_decay) if config.ema_decay is not None else None
    main = is_main_process()
    step, elapsed_before = 0, 0.0
    if resume and state_path is not None and Path(state_path).is_file():
        step, elapsed_before = resume_training(state_path, module, ema, optimizer, run_info)
        if main:
            log(f"resumed from {state_path} at step {step}")
    autocast = _autocast(config, params[0].device.type)
    budget = Budget(config, elapsed_before, params[0].device)
    first_step = step
    reports = StepLog(config, first_step, main, jsonl_path, log)
    checkpoints = Checkpointer(state_path, main, module, ema, optimizer, run_info, reports.flush)
    evaluations = Evaluations(evaluate, config.eval_every, first_step, main, eval_jsonl_path, log)

    model.train()
    while (lr := budget.learning_rate(step)) is not None:
        loss, grad_norm = optimizer_step(model, loss_fn, step, optimizer, params, lr, config.grad_clip, autocast,
                                         config.accumulation_steps)
        if ema is not None:
            ema.update(module)
        step += 1
        reports.step(step, global_mean(loss.detach()), lr, grad_norm, budget.elapsed())
        if step % config.checkpoint_every == 0:
            checkpoints.save(step, budget.elapsed())
        evaluations.after(step, model, final=False)
    reports.close(budget.elapsed())
    if step > first_step and step % config.checkpoint_every:
        checkpoints.save(step, budget.elapsed())
    if budget.finished:
        evaluations.after(step, model, final=True)
    model.eval()
    return TrainResult(steps=step, seconds=budget.elapsed(), history=reports.history, ema=ema,
                       finished=budget.finished, evaluations=evaluations.rows)


class Evaluations:
    """Periodic evaluation during training: ``evaluate()`` every ``every`` steps (and once at the end), the model
    in eval mode meanwhile; rows {"step", **result} kept, logged and, on the main process, appended to a JSONL
    file (whose rows past ``first_step`` a resumed run drops)."""

    def __init__(self, evaluate: Callable[[], dict] | None, every: int | None, first_step: int, main: bool,
                 jsonl_path: str | Path | None, log: Callable[[str], None]):
        self.evaluate, self.every, self.main, self.log = evaluate, every, main, log
        self.path = Path(jsonl_path) if jsonl_path is not None and main and evaluate is not None else None
        if self.path is not None:
            _truncate_jsonl(self.path, first_step)
        self.rows: list[dict] = []

    def after(self, step: int, model: torch.nn.Module, final: bool) -> None:
        """Evaluate after ``step`` if it is due (every ``every`` steps, or ``final`` unless just done)."""
        if self.evaluate is None or (self.rows and self.rows[-1]["step"] == step):
            return
        if not final and (self.every is None or step % self.every):
            return
        model.eval()
        row = {"step": step, **self.evaluate()}
        model.train()
        self.rows.append(row)
        if self.main:
            self.log("eval " + "  ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                         for k, v in row.items()))
        if self.path is not None:
            with self.path.open("a") as handle:
                handle.write(json.dumps(row) + "\n")


def _row(step: int, loss: float, lr: float, grad_norm: float, seconds: float, digits: int) -> dict:
    """One logged row: the step, its (mean) loss, learning rate, gradient norm and wall seconds so far."""
    return {"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm, "seconds": round(seconds, digits)}


def _progress_bar(enabled: bool, total: int | None, initial: int):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, desc="training", unit="step", dynamic_ncols=True)


def _truncate_jsonl(path: Path, step: int) -> None:
    """Keep the rows of the per-step log at steps <= ``step`` (all of them are dropped at step 0)."""
    rows = []
    if step > 0 and path.is_file():
        rows = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= step]
    write_text_atomic("".join(line + "\n" for line in rows), path)
