"""``python -m sparsevid_lab distill``: fine-tune the built-in video DiT's transformer into a sparse-attention
student with the library's training path (:func:`sparsevid.training.distill`, as for any diffusers model; the
caption encoder supplies the text states), by velocity distillation from its dense self (``--objective distill``)
or by the flow-matching loss on the data (``--objective diffusion``, the baseline). Runs on one process or under
``torchrun`` (data parallel)."""
from __future__ import annotations

from pathlib import Path

from sparsevid.cli.args import (CommandError, config_spec_arg, default_device, device_arg, positive_float_arg,
                                positive_int_arg)

from .args import add_slice_arguments, clip_arg, model_dir_arg, slice_options

DATA_KINDS = ("procedural", "dir", "teacher")


def add_parser(subparsers) -> None:
    summary = ("Fine-tune the built-in video model so that its sparse attention matches its dense self "
               "(velocity distillation; --objective diffusion trains on the data instead, the baseline). Runs "
               "on one process or under torchrun (data parallel).")
    p = subparsers.add_parser("distill", description=summary,
                              help="Fine-tune the model so that its sparse attention matches its dense self.")
    p.add_argument("--out", required=True, help="directory for the state, log, loss curve and the student")
    p.add_argument("--objective", default="distill", choices=("distill", "diffusion"),
                   help="distill: match the dense teacher's velocity; diffusion: the flow-matching loss on the data")
    p.add_argument("--config", type=config_spec_arg, default=None, metavar="SPEC",
                   help="the student's sparse attention: SparseConfig fields as 'key=value,...' or a JSON file "
                        "(without it: SparseConfig(), the hybrid of top-k and top-p)")
    p.add_argument("--clip", type=clip_arg, default=None, metavar="T,H,W",
                   help="clip frames, height, width (default: the model's own)")
    p.add_argument("--model", type=model_dir_arg, default=None,
                   help="pretrained model directory (without it: the shipped model)")
    p.add_argument("--tiny", action="store_true", help="use an untrained tiny model instead (a quick smoke test)")
    p.add_argument("--data", default="procedural", choices=DATA_KINDS,
                   help="procedural clips, clip files in --data-dir, or clips sampled from the teacher")
    p.add_argument("--data-dir", default=None, help="clip files (--data dir) or the teacher cache (--data teacher; "
                                                    "without it: OUT/teacher_cache)")
    p.add_argument("--data-seed", type=int, default=1, help="seed of the procedural clips / file order")
    add_slice_arguments(p, "procedural clips")
    p.add_argument("--teacher-samples", type=positive_int_arg, default=64, help="clips in the teacher cache")
    p.add_argument("--teacher-steps", type=positive_int_arg, default=None,
                   help="sampler steps for the teacher cache (without it: the model's own)")
    p.add_argument("--batch-size", type=positive_int_arg, default=16, help="global batch (split over processes)")
    p.add_argument("--max-steps", type=positive_int_arg, default=None,
                   help="step budget (give it, --minutes or both)")
    p.add_argument("--minutes", type=positive_float_arg, default=None,
                   help="wall-clock budget (give it, --max-steps or both)")
    p.add_argument("--lr", type=positive_float_arg, default=5e-5, help="peak learning rate (AdamW)")
    p.add_argument("--warmup", type=int, default=20, help="steps of linear learning-rate warm-up")
    p.add_argument("--grad-clip", type=float, default=1.0, help="gradient-norm clipping threshold")
    p.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay")
    p.add_argument("--ema", type=float, default=None,
                   help="decay of an exponential moving average of the weights (without it: no average)")
    p.add_argument("--trainable", default="attention", choices=("attention", "all"),
                   help="which transformer weights are trained: the self-attention layers only, or all (the caption "
                        "encoder stays frozen: it makes the text states, as a real model's text encoder)")
    p.add_argument("--gradient-checkpointing", action="store_true",
                   help="recompute activations in the backward pass (less memory, more time)")
    p.add_argument("--no-bf16", action="store_true", help="train in fp32 on CUDA (bf16 autocast otherwise)")
    p.add_argument("--train-shift", type=positive_float_arg, default=None,
                   help="shift of the logit-normal noise levels (without it: the model's pre-training value)")
    p.add_argument("--null-prob", type=float, default=None,
                   help="probability of the empty caption (without it: the model's pre-training value)")
    p.add_argument("--seed", type=int, default=0, help="seed of the noise and noise levels")
    p.add_argument("--resume", action="store_true", help="continue from OUT/state.safetensors if present")
    p.add_argument("--checkpoint-every", type=positive_int_arg, default=100, help="steps between saved states")
    p.add_argument("--log-every", type=positive_int_arg, default=10, help="steps between log lines")
    p.add_argument("--no-progress", action="store_true", help="log lines instead of a progress bar")
    p.add_argument("--device", type=device_arg, default=default_device(), help="where to train: cpu, cuda or cuda:N")
    p.set_defaults(func=run)


def _source(args, model, job):
    """The fine-tuning data named by --data."""
    from ..data import ProceduralVideos
    from ..data.sources import DirectorySource, ProceduralSource
    from ..data.teacher_cache import teacher_cache

    if args.data == "dir":
        try:
            return DirectorySource(args.data_dir, seed=args.data_seed)
        except ValueError as error:  # the user's clip files
            raise CommandError(f"--data-dir {args.data_dir}: {error}") from None
    data = model.data
    if args.max_objects is not None and args.max_objects > data.max_objects:
        raise CommandError(f"--max-objects must be at most {data.max_objects} (the model's captions), "
                           f"got {args.max_objects}")
    options = slice_options(args)
    if options:
        data = ProceduralVideos(**{**data.config(), **options})
    if args.data == "procedural":
        return ProceduralSource(data, seed=args.data_seed)
    directory = Path(args.data_dir) if args.data_dir else Path(args.out) / "teacher_cache"
    return teacher_cache(model, directory, args.teacher_samples, seed=args.data_seed, steps=args.teacher_steps,
                         rank=job.rank, world_size=job.world_size, progress=not args.no_progress)


def run(args) -> int:
    from sparsevid.training import setup, teardown

    from ..data import SLICE_FIELDS

    if args.minutes is None and args.max_steps is None:
        raise CommandError("give --minutes, --max-steps or both: how long to train")
    if args.data == "procedural" and args.data_dir is not None:
        raise CommandError("--data-dir needs --data dir or --data teacher, got --data procedural")
    sliced = [f"--{field}" for field in SLICE_FIELDS if getattr(args, field) is not None]
    if sliced and args.data != "procedural":
        raise CommandError(f"{' '.join(sliced)} select procedural clips: they need --data procedural, "
                           f"got --data {args.data}")
    if args.data == "dir" and args.data_dir is None:
        raise CommandError("--data dir needs --data-dir, the directory of clip files")
    job = setup(args.device)
    try:
        _distill(args, job)  # the model is gone with _distill's frame: the process group can be freed
    finally:
        teardown()
    return 0


def _distill(args, job) -> None:
    """Distill the built-in model of ``args`` on ``job``'s device and report it on the main process."""
    from sparsevid.plan import SparseConfig, parse_config
    from sparsevid.training import DistillConfig, LoopConfig, distill, is_main_process

    from ..model.builtin import CaptionedClips, pretraining_noise
    from .demo import load_model

    args.device = str(job.device)
    model = load_model(args).float()
    shift, null_prob = pretraining_noise(model, args.train_shift, args.null_prob)
    config = DistillConfig(
        objective=args.objective, sparse=SparseConfig() if args.config is None else parse_config(args.config),
        trainable=args.trainable,
        batch_size=args.batch_size, seed=args.seed,
        shift=shift, null_prob=null_prob,
        gradient_checkpointing=args.gradient_checkpointing)
    loop = LoopConfig(lr=args.lr, warmup_steps=args.warmup, grad_clip=args.grad_clip,
                      weight_decay=args.weight_decay, ema_decay=args.ema, max_steps=args.max_steps,
                      max_seconds=None if args.minutes is None else args.minutes * 60, bf16=not args.no_bf16,
                      log_every=args.log_every, checkpoint_every=args.checkpoint_every,
                      progress=not args.no_progress)
    source = CaptionedClips(model, _source(args, model, job))
    result = distill(model.transformer, source, config, loop, out=args.out, resume=args.resume,
                     device=job.device)
    if is_main_process():
        if not result.history:
            print(f"nothing to train: the state in {args.out} is already at step {result.steps}")
        else:
            print(f"trained to step {result.steps} in {result.seconds:.0f}s, final loss "
                  f"{result.history[-1]['loss']:.3g}; wrote the student to {args.out} (student.safetensors, "
                  f"student.json), log.jsonl and loss.png")
