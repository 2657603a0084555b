"""Trainable sparse attention for any diffusers video transformer of a flow-matching family: velocity distillation
and the diffusion-loss baseline, on latents with their text conditioning.

The student is the pretrained transformer with its self-attentions made block-sparse (``apply_sparse_attention``);
the teacher is the same transformer run dense on frozen copies of the weights fine-tuning changes
(:class:`~sparsevid.training.velocity.DenseTeacher`). For latents x0, noise and noise levels t drawn as in
pre-training (logit-normal, shifted), x_t = (1 - t) x0 + t noise, the ``"distill"`` objective is
``mean((v_student(x_t, t, c) - v_teacher(x_t, t, c))^2)``; the ``"diffusion"`` baseline is the flow-matching loss
``mean((v_student - (noise - x0))^2)``. Both run in :func:`~sparsevid.training.loop.train_loop`, on one process or
data-parallel under ``torchrun``; every random draw is keyed by the global sample index (:mod:`.draws`).
"""
from __future__ import annotations

import copy
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..integration import adapter_for, apply_sparse_attention, is_sparse, reset_denoising_step
from ..integration.adapters import latent_families
from ..plan import SparseConfig
from .distributed import Distributed, is_main_process, setup, wrap
from .draws import STREAM_NOISE, sample_generator
from .flow import FULL_RANGE, check_noise_range, flow_matching_loss, noisy, sample_t
from .latents import LatentBatch
from .loop import LoopConfig, train_loop
from .lora import add_lora
from .sharding import full_model_state, shard
from .student import TRAINABLE, base_fingerprint, save_student, trainable_names
from .velocity import DenseTeacher, check_flow_family, predict_velocity

OBJECTIVES = ("distill", "diffusion")
STATE_FILE, LOG_FILE, EVAL_LOG_FILE = "state.safetensors", "log.jsonl", "eval.jsonl"


@dataclass
class DistillConfig:
    """What to train and on which draws.

    Args:
        objective: "distill" (match the dense teacher) or "diffusion" (flow matching on the data).
        sparse: the student's sparse attention (default ``SparseConfig()``, the hybrid rule; one rule at every
            noise level: ``schedule="constant"``,
            ``dense_steps=0``); None fine-tunes the dense model (with ``objective="diffusion"`` only: a dense
            student would distil into itself), the control that shows what the fine-tuning data alone do.
        trainable: the self-"attention" modules only (default), "all" parameters, or a "lora" adapter on the
            self-attention projections (:mod:`.lora`; base weights frozen, the cheapest in memory).
        lora_rank, lora_alpha: the adapter's rank and scale numerator (scale alpha / rank), for "lora".
        batch_size: the global batch (split evenly over the ranks of a data-parallel job).
        seed: seeds the noise, noise levels and caption dropout of every sample index.
        shift, logit_std: the noise-level distribution (``sample_t``), as in pre-training (Wan: shift 1 in
            training with the sampler at 3-5; a model's own recipe wins).
        noise_range: (low, high), the noise levels trained, that distribution restricted to them (default all; an
            expert of a two-expert pipeline, e.g. Wan2.2 A14B's ``transformer_2``, at those it serves: (0, 0.875)).
        null_prob: probability that a sample's text becomes the empty prompt's (keeps guidance working).
        gradient_checkpointing: recompute the transformer blocks in the backward pass.
        compile: a ``torch.compile`` backend ("inductor" on CUDA) for the transformer's repeated blocks
            (``compile_repeated_blocks``), or None to run eagerly.
    """

    objective: str = "distill"
    sparse: SparseConfig | None = field(default_factory=SparseConfig)
    trainable: str = "attention"
    batch_size: int = 8
    seed: int = 0
    shift: float = 1.0
    logit_std: float = 1.0
    noise_range: tuple[float, float] = FULL_RANGE
    null_prob: float = 0.1
    gradient_checkpointing: bool = False
    lora_rank: int = 64
    lora_alpha: float = 64.0
    compile: str | None = None

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
        for name in ("batch_size", "seed", "lora_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"{name} must be an int, got {value!r}")
        if self.batch_size < 1 or self.seed < 0 or self.lora_rank < 1:
            raise ValueError(f"batch_size and lora_rank must be >= 1 and seed >= 0, got {self.batch_size}, "
                             f"{self.lora_rank}, {self.seed}")
        if not self.lora_alpha > 0:
            raise ValueError(f"lora_alpha must be positive, got {self.lora_alpha}")
        if self.shift <= 0 or self.logit_std <= 0:
            raise ValueError(f"shift and logit_std must be positive, got {self.shift}, {self.logit_std}")
        check_noise_range(self.noise_range)
        if not 0 <= self.null_prob < 1:
            raise ValueError(f"null_prob must be in [0, 1), got {self.null_prob}")
        if not isinstance(self.gradient_checkpointing, bool):
            raise TypeError(f"gradient_checkpointing must be a bool, got {self.gradient_checkpointing!r}")
        if self.compile is not None and self.compile not in torch._dynamo.list_backends(exclude_tags=()):
            raise ValueError(f"compile must be None or a torch.compile backend, got {self.compile!r}")

    def run_info(self, source) -> dict:
        """The settings a resumed run must share (JSON-normalised): they fix the sequence of draws."""
        info = {"objective": self.objective, "sparse": None if self.sparse is None else self.sparse.to_dict(),
                "trainable": self.trainable, **self.lora_settings(), "batch_size": self.batch_size, "seed": self.seed,
                "shift": self.shift, "logit_std": self.logit_std, "null_prob": self.null_prob,
                "data": source.describe()}
        if self.noise_range != FULL_RANGE:  # (absent from runs before it existed, which trained every level)
            info["noise_range"] = list(self.noise_range)
        return json.loads(json.dumps(info))

    def lora_settings(self) -> dict:
        """{"lora_rank", "lora_alpha"} for a LoRA student, else {}."""
        return {"lora_rank": self.lora_rank, "lora_alpha": self.lora_alpha} if self.trainable == "lora" else {}


class Draws:
    """The per-rank batch of each micro-step: global sample indices ``m * M + rank * b + j`` (M = B / A the samples
    of one micro-step over all ranks, B the global batch of an optimiser step, A its gradient-accumulation steps,
    b = M / world_size), each with its own noise level, caption dropout and noise (drawn in that order from the
    index's generator). Without accumulation a micro-step is an optimiser step.

    Calling it with a micro-step returns (batch: LatentBatch with dropped texts replaced, t float32 [b], noise
    float32 like the latents), on ``device``."""

    def __init__(self, source, config: DistillConfig, rank: int, world_size: int, device, accumulation_steps: int = 1):
        if config.batch_size % (world_size * accumulation_steps):
            raise ValueError(f"batch_size ({config.batch_size}) must be divisible by the number of processes "
                             f"({world_size}) times the accumulation steps ({accumulation_steps})")
        self.source, self.config, self.device = source, config, torch.device(device)
        self.per_micro_step = config.batch_size // accumulation_steps
        self.per_rank = self.per_micro_step // world_size
        self.offset = rank * self.per_rank
        self.null = source.null_text()

    def indices(self, micro_step: int) -> list[int]:
        start = micro_step * self.per_micro_step + self.offset
        return list(range(start, start + self.per_rank))

    def __call__(self, micro_step: int) -> tuple[LatentBatch, torch.Tensor, torch.Tensor]:
        cfg = self.config
        indices = self.indices(micro_step)
        batch = self.source.batch(indices, self.device)
        ts, noises, drops = [], [], []
        for index in indices:
            generator = sample_generator(cfg.seed, index, STREAM_NOISE)
            ts.append(sample_t(1, generator, shift=cfg.shift, logit_std=cfg.logit_std, noise_range=cfg.noise_range))
            drops.append(torch.rand(1, generator=generator) < cfg.null_prob)
            noises.append(torch.randn(batch.latents.shape[1:], generator=generator))
        batch = batch.drop_text(torch.cat(drops), self.null)
        return batch, torch.cat(ts).to(self.device), torch.stack(noises).to(self.device)


def check_source(transformer: torch.nn.Module, source) -> None:
    """ValueError when ``source``'s samples do not fit ``transformer``: the family whose pipeline cached them (when it
    is one sparsevid knows; a pipeline of one's own, such as a pixel-space model's, is judged by the shapes alone),
    latent channels (those it predicts; conditioning channels come as ``extra.condition_latents``), text width."""
    adapter = adapter_for(transformer)
    made_by = getattr(source, "settings", {}).get("family")
    takes = adapter.latents or adapter.name
    if made_by in latent_families() and made_by != takes:
        raise ValueError(f"the data were cached by a {made_by!r} pipeline, but the {type(transformer).__name__} "
                         f"takes {takes!r} latents and text states: data made for another model")
    config = transformer.config
    channels = adapter.channels(config)[0]
    if source.latent_shape[0] != channels:
        raise ValueError(f"the data's latents have {source.latent_shape[0]} channels but the "
                         f"{type(transformer).__name__} takes {channels}: data made for another model?")
    text_dim = next((getattr(config, name) for name in ("text_dim", "text_embed_dim", "in_text_dim")
                     if hasattr(config, name)), None)
    text_shape = getattr(source, "text_shape", None)
    if text_dim is not None and text_shape is not None and text_shape[-1] != text_dim:
        raise ValueError(f"the data's text states have width {text_shape[-1]} but the {type(transformer).__name__} "
                         f"takes {text_dim}: data encoded for another model?")


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
    evaluations: list[dict] = field(default_factory=list)


PARALLEL = ("ddp", "fsdp")


@dataclass
class Distillation:
    """A transformer made ready for fine-tuning by :func:`prepare_distillation`.

    Attributes:
        transformer: the student module (sparse attention applied, trainable tensors float32, the rest frozen).
        student: what a training step calls: ``transformer`` itself, or its DDP / FSDP wrapper.
        loss_fn: micro-step index -> the objective on that micro-step's draws (a scalar; see :class:`Draws`).
        parameters: the trainable parameters, in ``named_parameters`` order.
        base: the base fingerprint of the pretrained weights (``student.json``).
        lora: {"rank", "alpha", "targets"} of a LoRA student, else None.
        sharded: the student is FSDP-sharded.
        job: this process's place in the job (rank, world size, device).
    """

    transformer: torch.nn.Module
    student: torch.nn.Module
    loss_fn: Callable[[int], torch.Tensor]
    parameters: list[torch.nn.Parameter]
    base: str
    lora: dict | None
    sharded: bool
    job: Distributed


def prepare_distillation(transformer: torch.nn.Module, source, config: DistillConfig,
                         device: str | torch.device | None = None, accumulation_steps: int = 1,
                         parallel: str = "ddp") -> Distillation:
    """Turn the dense pretrained ``transformer`` into the student that :func:`distill` trains, on ``device`` (this
    process's device of the job; default the transformer's), with its dense teacher and objective: adapters (LoRA),
    the frozen teacher copies, sparse attention, trainable tensors upcast to float32 (master weights; the frozen
    ones keep their dtype, bf16 for a model loaded so), gradient checkpointing, ``config.compile`` and the
    data-parallel wrapper. Checks first that the transformer is a dense one of a flow-matching family and that
    ``source``'s samples fit it."""
    check_flow_family(transformer)
    if is_sparse(transformer):
        raise ValueError("transformer already has sparse attention; pass the dense pretrained transformer")
    check_source(transformer, source)
    job = setup(device if device is not None else next(transformer.parameters()).device)
    transformer.to(job.device)
    draws = Draws(source, config, job.rank, job.world_size, job.device, accumulation_steps)
    base = base_fingerprint(transformer, config.trainable)
    lora = None
    if config.trainable == "lora":
        targets = add_lora(transformer, config.lora_rank, config.lora_alpha, seed=config.seed)
        lora = {"rank": config.lora_rank, "alpha": config.lora_alpha, "targets": targets}
    names = trainable_names(transformer, config.trainable)
    sharded = parallel == "fsdp" and job.world_size > 1
    if sharded and config.compile is not None:
        raise ValueError("compile with parallel='fsdp' is not supported: use parallel='ddp' or compile=None")
    teacher = None
    if config.objective == "distill" and sharded and lora is None:
        # Frozen copies of shards cannot stand in for the student's (FSDP gathers its own): a frozen sharded copy.
        teacher = DenseTeacher(shard(copy.deepcopy(transformer).requires_grad_(False)), [])
    elif config.objective == "distill":
        teacher = DenseTeacher(transformer, [] if lora else names, adapters=lora is not None)
    if config.sparse is not None:
        apply_sparse_attention(transformer, config.sparse)
    wanted = set(names)
    parameters = []
    for name, parameter in transformer.named_parameters():
        parameter.requires_grad_(name in wanted)
        if name in wanted:
            parameter.data = parameter.data.float()
            parameters.append(parameter)
    if config.gradient_checkpointing:
        transformer.enable_gradient_checkpointing()
    if config.compile is not None:
        transformer.compile_repeated_blocks(backend=config.compile)
    student = shard(transformer) if sharded else wrap(transformer, job)

    def loss_fn(micro_step: int) -> torch.Tensor:
        batch, t, noise = draws(micro_step)
        if config.sparse is not None:
            reset_denoising_step(transformer)  # every forward predicts its own masks
        x_t = noisy(batch.latents, noise, t)
        velocity = predict_velocity(student, x_t, t, batch, module=transformer)
        if teacher is None:
            return flow_matching_loss(velocity, batch.latents, noise)
        return torch.nn.functional.mse_loss(velocity.float(), teacher(x_t, t, batch).float())

    return Distillation(transformer, student, loss_fn, parameters, base, lora, sharded, job)


def distill(transformer: torch.nn.Module, source, config: DistillConfig, loop: LoopConfig,
            out: str | Path | None = None, resume: bool = False, device: str | torch.device | None = None,
            log=print, extra: dict | None = None, evaluate=None, parallel: str = "ddp") -> DistillResult:
    """Fine-tune ``transformer`` (a dense, pretrained diffusers video transformer of a flow-matching family) in
    place into a sparse-attention student; on return its self-attentions stay sparse with ``config.sparse``.

    source: the fine-tuning latents and texts (:mod:`sparsevid.training.latents`); loop: optimiser and budget.
    out: directory for the training state (``state.safetensors``, resumable with ``resume``), the per-step log
    (``log.jsonl``) and, once the budget is used up, the student (:func:`~sparsevid.training.student.save_student`;
    ``extra`` goes into its ``student.json``). Under ``torchrun`` each process calls this; rank 0 writes the files.
    ``device`` defaults to the transformer's. ``evaluate() -> dict``: a periodic held-out measurement
    (``loop.eval_every``; e.g. :func:`sparsevid.eval.velocity_tracker`), logged to ``eval.jsonl``.
    ``parallel`` (several processes): "ddp" replicates the model on every rank; "fsdp" shards it (FSDP2, each
    block and the root), the dense teacher then being a sharded frozen copy (none for LoRA students).
    The transformer may come in bf16 (``from_pretrained(torch_dtype=torch.bfloat16)``, the least memory): the
    tensors it trains become float32 master weights, the frozen ones stay bf16.
    """
    if not isinstance(config, DistillConfig):
        raise TypeError(f"config must be a DistillConfig, got {type(config).__name__}")
    if not isinstance(loop, LoopConfig):
        raise TypeError(f"loop must be a LoopConfig, got {type(loop).__name__}")
    if parallel not in PARALLEL:
        raise ValueError(f"parallel must be one of {PARALLEL}, got {parallel!r}")
    run = prepare_distillation(transformer, source, config, device, loop.accumulation_steps, parallel)
    job = run.job

    out = Path(out) if out is not None else None
    run_info = {**config.run_info(source), "accumulation_steps": loop.accumulation_steps}
    trainable = sum(p.numel() for p in run.parameters)
    if is_main_process():
        log(f"{config.objective}: {trainable / 1e6:.2f}M trainable parameters ({config.trainable}), global batch "
            f"{config.batch_size} over {job.world_size} process(es), data {source.describe()}")
    result = train_loop(run.student, run.loss_fn, loop, state_path=None if out is None else out / STATE_FILE,
                        resume=resume, log=log, run_info=run_info,
                        jsonl_path=None if out is None else out / LOG_FILE, evaluate=evaluate,
                        eval_jsonl_path=None if out is None else out / EVAL_LOG_FILE)
    if result.ema is not None:
        result.ema.copy_to(transformer)
    writes_student = out is not None and bool(result.history) and result.finished and config.sparse is not None
    state = full_model_state(transformer) if writes_student and run.sharded else None  # a collective
    if writes_student and is_main_process():
        summary = {"objective": config.objective, "steps": result.steps, "seconds": round(result.seconds, 1),
                   "final_loss": result.history[-1]["loss"], "world_size": job.world_size, "run": run_info,
                   **(extra or {})}
        save_student(transformer, out, config.sparse, config.trainable, run.base, extra=summary, lora=run.lora,
                     state=state)
        _plot_log(out / LOG_FILE, out / "loss.png", config.objective)
    return DistillResult(result.steps, result.seconds, result.history, trainable, out, result.finished,
                         result.evaluations)


def _plot_log(log_path: Path, png: Path, objective: str) -> None:
    from .plots import plot_loss

    rows = [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()]
    ylabel = "velocity distillation loss (MSE)" if objective == "distill" else "flow-matching loss (MSE)"
    plot_loss(rows, png, title=f"{objective}, {rows[-1]['step']} steps", ylabel=ylabel)
