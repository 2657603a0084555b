"""Trainable sparse attention by velocity distillation.

The student is a pretrained video DiT whose self-attentions are made block-sparse
(``apply_sparse_attention``); the teacher is a frozen dense copy of the same weights. For clean clips x0,
noise ε and noise levels t drawn as in pre-training (logit-normal, shifted), x_t = (1 - t) x0 + t ε, the
``"distill"`` objective is ``mean((v_student(x_t, t, c) - v_teacher(x_t, t, c))^2)`` (teacher under
no_grad); the ``"diffusion"`` baseline is the flow-matching loss ``mean((v_student - (ε - x0))^2)``.
Both run in :func:`~sparsevid.training.loop.train_loop`, on one process or data-parallel under
``torchrun``; every random draw is keyed by the global sample index (see :mod:`.sources`).
"""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..models.sparse_student import TRAINABLE
from ..schedules import SparseConfig
from .checkpoint import export_builtin, write_text_atomic
from .distributed import is_main_process, setup, wrap
from .flow import flow_matching_loss, noisy, sample_t
from .loop import LoopConfig, train_loop
from .sources import STREAM_NOISE, sample_generator

OBJECTIVES = ("distill", "diffusion")
STATE_FILE, LOG_FILE, SPARSE_CONFIG_FILE, TRANSFORMER_DIR = ("state.safetensors", "log.jsonl",
                                                             "sparse_config.json", "transformer")


def distillation_loss(student, teacher, x0: torch.Tensor, cond: torch.Tensor, t: torch.Tensor,
                      noise: torch.Tensor) -> torch.Tensor:
    """Mean squared difference of the student's and the (no-grad) teacher's velocity at x_t.

    student, teacher: ``model(x_t, t, cond) -> velocity``; x0, noise: [B, C, T, H, W]; t: [B] in [0, 1];
    cond: the conditioning both models take (e.g. caption tokens int64 [B, L]).
    """
    x_t = noisy(x0, noise, t)
    with torch.no_grad():
        target = teacher(x_t, t, cond)
    return torch.nn.functional.mse_loss(student(x_t, t, cond).float(), target.float())


def pretraining_noise(model, shift: float | None = None, null_prob: float | None = None) -> tuple[float, float]:
    """(time shift, caption-dropout probability) for fine-tuning ``model``: the given values, else those it was
    pre-trained with (its config's "training" arguments), else 1.0 and 0.1."""
    arguments = model.config.get("training", {}).get("arguments", {})
    return (arguments.get("train_shift", 1.0) if shift is None else shift,
            arguments.get("null_prob", 0.1) if null_prob is None else null_prob)


def _default_sparse() -> SparseConfig:
    return SparseConfig(rule="hybrid", topk=0.05, topp=0.9)


@dataclass
class DistillConfig:
    """What to train and on which draws.

    Args:
        objective: "distill" (match the dense teacher) or "diffusion" (flow matching on the data).
        sparse: the student's sparse attention (constant over noise levels: ``schedule="constant"``,
            ``dense_steps=0``); None fine-tunes the dense model (with ``objective="diffusion"`` only: a dense
            student would distil into itself), the control that shows what the fine-tuning data alone do.
        trainable: "all" parameters or the self-"attention" modules only.
        batch_size: the global batch (split evenly over the ranks of a data-parallel job).
        seed: seeds the noise, noise levels and caption dropout of every sample index.
        shift, logit_std: the noise-level distribution (``sample_t``), as in pre-training.
        null_prob: probability that a sample's caption becomes the null caption (keeps guidance working).
        gradient_checkpointing: recompute the transformer blocks in the backward pass.
    """

    objective: str = "distill"
    sparse: SparseConfig | None = field(default_factory=_default_sparse)
    trainable: str = "all"
    batch_size: int = 8
    seed: int = 0
    shift: float = 1.0
    logit_std: float = 1.0
    null_prob: float = 0.1
    gradient_checkpointing: bool = False

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {OBJECTIVES}, got {self.objective!r}")
        if self.sparse is None:
            if self.objective != "diffusion":
                raise ValueError("sparse=None (a dense student) needs objective='diffusion': a dense student "
                                 "already equals its dense teacher")
        elif not isinstance(self.sparse, SparseConfig):
            raise TypeError(f"sparse must be a sparsevid.SparseConfig or None, got {type(self.sparse).__name__}")
        elif self.sparse.dense_steps or self.sparse.schedule != "constant":
            raise ValueError("sparse must apply one rule at every noise level for training: need "
                             f"sparse.dense_steps=0 and sparse.schedule='constant', got "
                             f"{self.sparse.dense_steps} and {self.sparse.schedule!r}")
        if self.trainable not in TRAINABLE:
            raise ValueError(f"trainable must be one of {TRAINABLE}, got {self.trainable!r}")
        for name in ("batch_size", "seed"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"{name} must be an int, got {value!r}")
        if self.batch_size < 1 or self.seed < 0:
            raise ValueError(f"batch_size must be >= 1 and seed >= 0, got {self.batch_size}, {self.seed}")
        if self.shift <= 0 or self.logit_std <= 0:
            raise ValueError(f"shift and logit_std must be positive, got {self.shift}, {self.logit_std}")
        if not 0 <= self.null_prob < 1:
            raise ValueError(f"null_prob must be in [0, 1), got {self.null_prob}")
        if not isinstance(self.gradient_checkpointing, bool):
            raise TypeError(f"gradient_checkpointing must be a bool, got {self.gradient_checkpointing!r}")

    def run_info(self, source) -> dict:
        """The settings a resumed run must share (JSON-normalised): they fix the sequence of draws."""
        info = {"objective": self.objective, "sparse": None if self.sparse is None else self.sparse.to_dict(),
                "trainable": self.trainable,
                "batch_size": self.batch_size, "seed": self.seed, "shift": self.shift,
                "logit_std": self.logit_std, "null_prob": self.null_prob, "data": source.describe()}
        return json.loads(json.dumps(info))


class Batches:
    """The per-rank batch of each training step: global sample indices ``step * B + rank * b + j``
    (B the global batch, b = B / world_size), each with its own noise, noise level and caption dropout.

    Calling it with a step returns x0 float32 [b, C, T, H, W], tokens int64 [b, L], t [b], noise like x0.
    """

    def __init__(self, model, source, config: DistillConfig, rank: int, world_size: int, device):
        if config.batch_size % world_size:
            raise ValueError(f"batch_size ({config.batch_size}) must be divisible by the number of processes "
                             f"({world_size})")
        if tuple(source.clip_shape) != tuple(model.clip_shape):
            raise ValueError(f"the data's clips have shape {tuple(source.clip_shape)} but the model takes "
                             f"{tuple(model.clip_shape)}")
        self.model, self.source, self.config, self.device = model, source, config, torch.device(device)
        self.per_rank = config.batch_size // world_size
        self.offset = rank * self.per_rank
        self.null = model.tokenize([""])

    def indices(self, step: int) -> list[int]:
        start = step * self.config.batch_size + self.offset
        return list(range(start, start + self.per_rank))

    def __call__(self, step: int):
        cfg = self.config
        indices = self.indices(step)
        x0, captions = self.source.clips(indices, self.device)
        tokens = self.model.tokenize(captions)
        ts, noises, drops = [], [], []
        for index in indices:
            generator = sample_generator(cfg.seed, index, STREAM_NOISE)
            ts.append(sample_t(1, generator, shift=cfg.shift, logit_std=cfg.logit_std))
            drops.append(torch.rand(1, generator=generator) < cfg.null_prob)
            noises.append(torch.randn(x0.shape[1:], generator=generator))
        tokens = torch.where(torch.cat(drops).unsqueeze(1), self.null, tokens).to(self.device)
        return x0, tokens, torch.cat(ts).to(self.device), torch.stack(noises).to(self.device)


def select_trainable(model, trainable: str) -> int:
    """Set ``requires_grad`` on ``model``'s parameters: every one ("all") or only those of the transformer's
    video self-attentions ("attention"). Returns how many parameters train."""
    from ..models.adapters import adapter_for

    if trainable not in TRAINABLE:
        raise ValueError(f"trainable must be one of {TRAINABLE}, got {trainable!r}")
    model.requires_grad_(trainable == "all")
    if trainable == "attention":
        for attention in adapter_for(model.transformer).self_attentions(model.transformer):
            attention.requires_grad_(True)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


@dataclass
class DistillResult:
    """``finished``: the step / time budget was used up (else ``LoopConfig.stop_at`` cut the call short; the
    state in ``out`` resumes it and no student was written)."""

    steps: int
    seconds: float
    history: list[dict]
    trainable_parameters: int
    out: Path | None = None
    finished: bool = True


def distill(model, source, config: DistillConfig, loop: LoopConfig, out: str | Path | None = None,
            resume: bool = False, device: str | torch.device | None = None, log=print) -> DistillResult:
    """Train ``model`` (a :class:`~sparsevid.models.BuiltinVideoDiT`, dense) in place into a sparse-attention
    student; on return its self-attentions stay sparse with ``config.sparse`` (dense if it is None).

    source: fine-tuning clips (:mod:`sparsevid.training.sources`); loop: optimiser and budget.
    out: directory for the training state (``state.safetensors``, resumable with ``resume``), the per-step
    log (``log.jsonl``) and, once the budget is used up, the student (see :func:`save_student`). Under ``torchrun`` each
    process calls this; rank 0 writes the files. ``device`` defaults to the model's.
    """
    from ..models.integration import apply_sparse_attention, is_sparse, reset_denoising_step

    if not isinstance(config, DistillConfig):
        raise TypeError(f"config must be a DistillConfig, got {type(config).__name__}")
    if not isinstance(loop, LoopConfig):
        raise TypeError(f"loop must be a LoopConfig, got {type(loop).__name__}")
    if is_sparse(model.transformer):
        raise ValueError("model already has sparse attention; pass the dense pretrained model")
    job = setup(device if device is not None else next(model.parameters()).device)
    model.to(job.device)
    batches = Batches(model, source, config, job.rank, job.world_size, job.device)
    teacher = None
    if config.objective == "distill":
        teacher = copy.deepcopy(model).requires_grad_(False).eval()
    if config.sparse is not None:
        apply_sparse_attention(model.transformer, config.sparse)
    trainable = select_trainable(model, config.trainable)
    if config.gradient_checkpointing:
        model.transformer.enable_gradient_checkpointing()
    student = wrap(model, job)

    def loss_fn(step: int) -> torch.Tensor:
        x0, tokens, t, noise = batches(step)
        if config.sparse is not None:
            reset_denoising_step(model.transformer)  # every forward predicts its own masks
        if teacher is None:
            return flow_matching_loss(student, x0, tokens, t, noise)
        return distillation_loss(student, teacher, x0, tokens, t, noise)

    out = Path(out) if out is not None else None
    run_info = config.run_info(source)
    if is_main_process():
        log(f"{config.objective}: {trainable / 1e6:.2f}M trainable parameters ({config.trainable}), global batch "
            f"{config.batch_size} over {job.world_size} process(es), data {source.describe()}")
    result = train_loop(student, loss_fn, loop, state_path=None if out is None else out / STATE_FILE,
                        resume=resume, log=log, run_info=run_info,
                        jsonl_path=None if out is None else out / LOG_FILE)
    if result.ema is not None:
        result.ema.copy_to(model)
    if out is not None and is_main_process() and result.history and result.finished:
        summary = {"objective": config.objective, "steps": result.steps, "seconds": round(result.seconds, 1),
                   "final_loss": result.history[-1]["loss"], "trainable": config.trainable,
                   "world_size": job.world_size, "run": run_info}
        save_student(model, config.sparse, out, summary)
        _plot_log(out / LOG_FILE, out / "loss.png", config.objective)
    return DistillResult(result.steps, result.seconds, result.history, trainable, out, result.finished)


def save_student(model, sparse: SparseConfig | None, directory: str | Path, summary: dict | None = None) -> Path:
    """Write the student into ``directory``: the built-in format (float32 ``builtin.safetensors`` +
    ``builtin.json`` with ``summary`` under "distillation"; ``python -m sparsevid eval --model``), the
    transformer as a diffusers model (``transformer/``, ``WanTransformer3DModel.from_pretrained``) and its
    ``sparse_config.json`` (``SparseConfig.from_json``; ``eval --config``; not written for a dense student,
    ``sparse`` None). Returns ``directory``."""
    directory = Path(directory)
    export_builtin(model, directory, dtype=torch.float32, extra={"distillation": summary or {}})
    model.transformer.save_pretrained(directory / TRANSFORMER_DIR)
    if sparse is not None:
        write_text_atomic(sparse.to_json(indent=2), directory / SPARSE_CONFIG_FILE)
    return directory


def load_student(directory: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
    """(model, SparseConfig) of a student that :func:`save_student` wrote into ``directory``, the model in eval
    mode on ``device`` in ``dtype``."""
    from ..models.builtin import load_builtin

    config = SparseConfig.from_json((Path(directory) / SPARSE_CONFIG_FILE).read_text())
    return load_builtin(directory, device=device, dtype=dtype), config


def _plot_log(log_path: Path, png: Path, objective: str) -> None:
    from .plots import plot_loss

    rows = [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()]
    ylabel = "velocity distillation loss (MSE)" if objective == "distill" else "flow-matching loss (MSE)"
    plot_loss(rows, png, title=f"{objective}, {rows[-1]['step']} steps", ylabel=ylabel)
