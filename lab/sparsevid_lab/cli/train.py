"""``python -m sparsevid_lab train``: train the built-in video DiT with the rectified-flow objective on procedural
clips."""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from sparsevid.cli.args import CommandError, default_device, device_arg, positive_float_arg, positive_int_arg

from .args import clip_arg, model_dir_arg

SAMPLE_CAPTIONS = (
    "big red plain circle moving right on a black background",
    "small yellow striped square bouncing and big blue plain ring circling on a gray background",
    "big white checkered diamond moving down on a navy background",
    "big green striped square moving left and small magenta plain circle moving up on a beige background",
)


def add_parser(subparsers) -> None:
    summary = ("Train the built-in video model with the rectified-flow objective on procedural clips (from "
               "scratch, or from a model directory with --init), then write its weights, loss curve, sample clips "
               "and log.")
    p = subparsers.add_parser("train", description=summary,
                              help="Train the built-in video model from scratch on procedural clips.")
    p.add_argument("--out", required=True, help="directory for the weights, config, loss curve, samples and log")
    p.add_argument("--minutes", type=positive_float_arg, default=None,
                   help="wall-clock training budget (give it, --max-steps or both)")
    p.add_argument("--max-steps", type=positive_int_arg, default=None,
                   help="step budget (give it, --minutes or both)")
    p.add_argument("--batch-size", type=positive_int_arg, action="append", default=None,
                   help="clips per step (default 64); repeat it, one per --clip, for mixed-resolution training")
    p.add_argument("--lr", type=positive_float_arg, default=4e-4, help="peak learning rate (AdamW)")
    p.add_argument("--warmup", type=int, default=200, help="steps of linear learning-rate warm-up")
    p.add_argument("--ema", type=float, default=0.999, help="decay of the weights' exponential moving average")
    p.add_argument("--train-shift", type=positive_float_arg, default=2.0,
                   help="shift of the logit-normal noise levels (larger: noisier training steps)")
    p.add_argument("--null-prob", type=float, default=0.1,
                   help="probability in [0, 1) of training on the empty caption (for classifier-free guidance)")
    p.add_argument("--seed", type=int, default=0, help="seed of the data, noise and initial weights")
    p.add_argument("--tiny", action="store_true", help="train the tiny configuration instead (tests, smoke runs)")
    p.add_argument("--init", type=model_dir_arg, default=None, metavar="DIR",
                   help="start from the model in DIR (weights and architecture; a warm restart: fresh optimiser)")
    p.add_argument("--grow-to-layers", type=positive_int_arg, default=None, metavar="N",
                   help="deepen the --init model to N transformer blocks before training: each block is followed "
                        "by copies of itself whose output layers start at zero, so training starts from what the "
                        "--init model computes")
    p.add_argument("--clip", type=clip_arg, action="append", default=None, metavar="T,H,W",
                   help="clip frames, height, width (without it: the model's); repeat it for mixed-resolution "
                        "training (each step draws its batch from one shape); the first is the shape the "
                        "exported model records as its own")
    p.add_argument("--clip-weight", type=positive_int_arg, action="append", default=None, metavar="N",
                   help="steps per cycle of each --clip, in order (default: 1 each, i.e. the shapes alternate)")
    p.add_argument("--background-texture", type=float, default=None,
                   help="strength of the procedural background texture in [0, 1] (without it: the model's)")
    p.add_argument("--pan", type=float, default=None,
                   help="camera pan of the background texture, in frame widths (without it: the model's)")
    p.add_argument("--compile", action="store_true", help="torch.compile the transformer")
    p.add_argument("--state", default=None, help="training-state file (without it: OUT/state.safetensors)")
    p.add_argument("--resume", action="store_true", help="continue from the training state if it exists")
    p.add_argument("--checkpoint-every", type=positive_int_arg, default=500, help="steps between saved states")
    p.add_argument("--log-every", type=positive_int_arg, default=25, help="steps between log lines")
    p.add_argument("--sample-steps", type=positive_int_arg, default=None,
                   help="sampler steps for the final sample clips (without it: the model's own)")
    p.add_argument("--device", type=device_arg, default=default_device(), help="where to train: cpu, cuda or cuda:N")
    p.set_defaults(func=run)


def clip_mix(args, model):
    """The :class:`ClipMix` of the command line: one clip source per ``--clip`` (the model's clip without
    one), with the model's data options, paired in order with ``--batch-size`` and ``--clip-weight``."""
    from ..data import ClipMix, ProceduralVideos
    from ..model.builtin import check_clip_shape

    shapes = args.clip or [None]
    batch_sizes = args.batch_size or [64]
    if len(batch_sizes) != len(shapes):
        raise CommandError(f"give one --batch-size per --clip: {len(shapes)} clip shape(s), "
                           f"{len(batch_sizes)} batch size(s)")
    if args.clip_weight is not None and len(args.clip_weight) != len(shapes):
        raise CommandError(f"give one --clip-weight per --clip: {len(shapes)} clip shape(s), "
                           f"{len(args.clip_weight)} weight(s)")
    datasets = []
    for shape in shapes:
        data = dict(model.config["data"])
        if shape is not None:
            try:
                check_clip_shape(model.config["transformer"]["patch_size"], *shape)
            except ValueError as error:
                raise CommandError(f"--clip {','.join(map(str, shape))}: {error}") from None
            data.update(frames=shape[0], height=shape[1], width=shape[2])
        for key, value in (("background_texture", args.background_texture), ("pan", args.pan)):
            if value is not None:
                data[key] = value
        try:
            datasets.append(ProceduralVideos(**data))
        except ValueError as error:  # the clip shape or background given on the command line
            raise CommandError(f"--clip / --background-texture / --pan: {error}") from None
    return ClipMix(datasets, batch_sizes, args.clip_weight)


def initial_model(args):
    """(model, mix, phases): the model to train, a fresh one (default or tiny configuration) or the one in
    ``--init``; the :class:`ClipMix` of the command line; the training phases the weights have been through
    (read from the ``--init`` model's config). The model's data (and config) take the first clip shape and
    the background options."""
    import copy

    from ..model.builtin import DEFAULT_CONFIG, BuiltinVideoDiT, deepen, load_builtin, tiny_config

    if args.init is not None and args.tiny:
        raise CommandError("give --init or --tiny, not both")
    if args.grow_to_layers is not None and args.init is None:
        raise CommandError("--grow-to-layers deepens the --init model: give --init DIR")
    if args.init is not None:
        model = load_builtin(args.init)
        training = model.config.pop("training", None)
        phases = model.config.pop("phases", [training] if training else [])
        if args.grow_to_layers is not None:
            try:
                model = deepen(model, args.grow_to_layers)
            except ValueError as error:
                raise CommandError(f"--grow-to-layers: {error}") from None
    else:
        model, phases = BuiltinVideoDiT(copy.deepcopy(tiny_config() if args.tiny else DEFAULT_CONFIG)), []
    mix = clip_mix(args, model)
    model.data = mix.datasets[0]  # the same weights, the (first) clips of this phase
    model.config["data"] = model.data.config()
    return model, mix, phases


def run(args) -> int:
    from ..eval.media import write_clips
    from ..model.sampling import generate
    from sparsevid.training import LoopConfig, sample_t, train_loop, write_text_atomic

    from ..model.builtin import export_builtin, pretraining_loss
    from sparsevid.training.plots import plot_loss

    if args.minutes is None and args.max_steps is None:
        raise CommandError("give --minutes, --max-steps or both: how long to train")
    if not 0 <= args.null_prob < 1:
        raise CommandError(f"--null-prob must lie in [0, 1), got {args.null_prob}")
    if args.warmup < 0:
        raise CommandError(f"--warmup must be >= 0, got {args.warmup}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log_file = (out / "train_log.txt").open("a")

    def log(line: str) -> None:
        print(line, flush=True)
        log_file.write(line + "\n")
        log_file.flush()

    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    model, mix, phases = initial_model(args)
    model = model.to(device)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: {n_params / 1e6:.2f}M parameters, clip {model.clip_shape}, device {device}")
    if len(mix.datasets) > 1:
        shapes = zip(mix.datasets, mix.batch_sizes, mix.weights)
        log("mixed clips (T x H x W, batch, weight): " + "; ".join(
            f"{d.frames}x{d.height}x{d.width}, {b}, {w}" for d, b, w in shapes))
    if args.compile:
        model.transformer.compile()
    gen = torch.Generator().manual_seed(args.seed)
    noise_gen = torch.Generator(device=device).manual_seed(args.seed + 1)
    null = model.tokenize([""])

    def loss_fn(step: int) -> torch.Tensor:
        video, captions = mix.sample(step, gen, device)
        batch = video.shape[0]
        tokens = model.tokenize(captions)
        drop = torch.rand(batch, generator=gen) < args.null_prob
        tokens = torch.where(drop.unsqueeze(1), null, tokens).to(device)
        t = sample_t(batch, gen, device, shift=args.train_shift)
        noise = torch.randn(video.shape, generator=noise_gen, device=device)
        return pretraining_loss(model, video, tokens, t, noise)

    config = LoopConfig(lr=args.lr, warmup_steps=args.warmup, ema_decay=args.ema, max_steps=args.max_steps,
                        max_seconds=None if args.minutes is None else args.minutes * 60,
                        log_every=args.log_every, checkpoint_every=args.checkpoint_every)
    state = Path(args.state) if args.state else out / "state.safetensors"
    result = train_loop(model, loss_fn, config, state_path=state, resume=args.resume, log=log)
    if not result.history:
        raise CommandError(f"nothing to train: the state at {state} is already at step {result.steps} "
                           f"(raise --max-steps or --minutes, or start without --resume)")
    final_loss = result.history[-1]["loss"]
    log(f"trained to step {result.steps} in {result.seconds:.0f}s, final loss {final_loss:.4f}")

    result.ema.copy_to(model)
    arguments = {k: v for k, v in vars(args).items() if k not in ("func", "out", "state")}
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    phase = {"arguments": arguments, "clip": list(model.clip_shape[1:]), "steps": result.steps,
             "batch_size": mix.batch_sizes[0], "seconds": round(result.seconds, 1), "final_loss": round(final_loss, 5),
             "device": device_name, "torch": torch.__version__, "parameters": n_params}
    if len(mix.datasets) > 1:  # mixed resolutions: every shape, its batch size, weight and steps
        phase["clips"] = [{"clip": [d.frames, d.height, d.width], "batch_size": b, "weight": w, "steps": n}
                          for d, b, w, n in zip(mix.datasets, mix.batch_sizes, mix.weights,
                                                mix.steps_per_shape(result.steps))]
    export_builtin(model, out, extra={"training": phase, "phases": phases + [phase]})
    write_text_atomic(json.dumps(result.history), out / "history.json")
    plot_loss(result.history, out / "loss.png", title=f"built-in DiT, {result.steps} steps")

    captions = [c for c in SAMPLE_CAPTIONS if model.data.fits(c)]
    model.eval()
    start = time.perf_counter()
    videos = generate(model, captions, seeds=list(range(len(captions))), steps=args.sample_steps)
    paths = write_clips(list(videos), out / "samples")
    log(f"samples ({len(captions)} captions, {time.perf_counter() - start:.1f}s): {', '.join(p.name for p in paths)}")
    log_file.close()
    return 0
