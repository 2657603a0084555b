"""``sparsevid train``: train the built-in video DiT with the rectified-flow objective on procedural clips."""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch

SAMPLE_CAPTIONS = (
    "big red plain circle moving right on a black background",
    "small yellow striped square bouncing and big blue plain ring circling on a gray background",
    "big white checkered diamond moving down on a navy background",
    "big green striped square moving left and small magenta plain circle moving up on a beige background",
)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("train", help="train the built-in video DiT (rectified flow) on procedural clips")
    p.add_argument("--out", required=True, help="directory for weights, config, loss curve, samples and log")
    p.add_argument("--minutes", type=float, default=None, help="wall-clock training budget")
    p.add_argument("--max-steps", type=int, default=None, help="step budget (with or instead of --minutes)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=4e-4)
    p.add_argument("--warmup", type=int, default=200, help="warm-up steps")
    p.add_argument("--ema", type=float, default=0.999, help="EMA decay")
    p.add_argument("--train-shift", type=float, default=2.0, help="shift of the logit-normal noise levels")
    p.add_argument("--null-prob", type=float, default=0.1, help="probability of the null caption (for CFG)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tiny", action="store_true", help="the tiny configuration (tests, smoke runs)")
    p.add_argument("--init", default=None, metavar="DIR",
                   help="start from the model in DIR (weights and architecture; a warm restart: fresh optimiser)")
    p.add_argument("--clip", default=None, metavar="T,H,W", help="clip frames, height, width (default: the model's)")
    p.add_argument("--background-texture", type=float, default=None,
                   help="strength of the procedural background texture in [0, 1] (default: the model's)")
    p.add_argument("--pan", type=float, default=None, help="camera pan of the background texture (frame widths)")
    p.add_argument("--compile", action="store_true", help="torch.compile the transformer")
    p.add_argument("--state", default=None, help="training-state file (default OUT/state.safetensors)")
    p.add_argument("--resume", action="store_true", help="continue from --state if it exists")
    p.add_argument("--checkpoint-every", type=int, default=500)
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--sample-steps", type=int, default=None, help="sampler steps for the final samples")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.set_defaults(func=run)


def initial_model(args):
    """The model to train: a fresh one (default or tiny configuration) or the one in ``--init``, with the
    clip shape and background options of the command line applied to its data. Its ``phases`` attribute
    lists the training phases the weights have been through (read from the ``--init`` model's config)."""
    import copy

    from ..data import ProceduralVideos
    from ..models.builtin import DEFAULT_CONFIG, BuiltinVideoDiT, load_builtin, tiny_config

    if args.init is not None and args.tiny:
        raise ValueError("give --init or --tiny, not both")
    if args.init is not None:
        model = load_builtin(args.init)
        training = model.config.pop("training", None)
        phases = model.config.pop("phases", [training] if training else [])
    else:
        model, phases = BuiltinVideoDiT(copy.deepcopy(tiny_config() if args.tiny else DEFAULT_CONFIG)), []
    data = model.config["data"]
    if args.clip is not None:
        try:
            frames, height, width = (int(x) for x in args.clip.split(","))
        except ValueError:
            raise ValueError(f"--clip must be three comma-separated ints T,H,W, got {args.clip!r}") from None
        data.update(frames=frames, height=height, width=width)
    for key, value in (("background_texture", args.background_texture), ("pan", args.pan)):
        if value is not None:
            data[key] = value
    model.data = ProceduralVideos(**data)  # the same weights, the clips of this phase
    model.phases = phases
    return model


def run(args) -> int:
    from ..eval.media import write_clips
    from ..models.sampling import generate
    from ..training import LoopConfig, export_builtin, flow_matching_loss, sample_t, train_loop, write_text_atomic
    from ..training.plots import plot_loss

    if args.minutes is None and args.max_steps is None:
        raise ValueError("give --minutes or --max-steps")
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be positive, got {args.batch_size}")
    if not 0 <= args.null_prob < 1:
        raise ValueError(f"--null-prob must be in [0, 1), got {args.null_prob}")
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
    model = initial_model(args).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: {n_params / 1e6:.2f}M parameters, clip {model.clip_shape}, device {device}")
    if args.compile:
        model.transformer.compile()
    data = model.data
    gen = torch.Generator().manual_seed(args.seed)
    noise_gen = torch.Generator(device=device).manual_seed(args.seed + 1)
    null = model.tokenize([""])

    def loss_fn(step: int) -> torch.Tensor:
        video, captions = data.sample(args.batch_size, gen, device)
        tokens = model.tokenize(captions)
        drop = torch.rand(args.batch_size, generator=gen) < args.null_prob
        tokens = torch.where(drop.unsqueeze(1), null, tokens).to(device)
        t = sample_t(args.batch_size, gen, device, shift=args.train_shift)
        noise = torch.randn(video.shape, generator=noise_gen, device=device)
        return flow_matching_loss(model, video, tokens, t, noise)

    config = LoopConfig(lr=args.lr, warmup_steps=args.warmup, ema_decay=args.ema, max_steps=args.max_steps,
                        max_seconds=None if args.minutes is None else args.minutes * 60,
                        log_every=args.log_every, checkpoint_every=args.checkpoint_every)
    state = Path(args.state) if args.state else out / "state.safetensors"
    result = train_loop(model, loss_fn, config, state_path=state, resume=args.resume, log=log)
    if not result.history:
        raise ValueError(f"nothing to train: the state at {state} is already at step {result.steps}")
    final_loss = result.history[-1]["loss"]
    log(f"trained to step {result.steps} in {result.seconds:.0f}s, final loss {final_loss:.4f}")

    result.ema.copy_to(model)
    arguments = {k: v for k, v in vars(args).items() if k not in ("func", "out", "state")}
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    phase = {"arguments": arguments, "clip": list(model.clip_shape[1:]), "steps": result.steps,
             "batch_size": args.batch_size, "seconds": round(result.seconds, 1), "final_loss": round(final_loss, 5),
             "device": device_name, "torch": torch.__version__, "parameters": n_params}
    export_builtin(model, out, extra={"training": phase, "phases": model.phases + [phase]})
    write_text_atomic(json.dumps(result.history), out / "history.json")
    plot_loss(result.history, out / "loss.png", title=f"built-in DiT, {result.steps} steps")

    captions = [c for c in SAMPLE_CAPTIONS if data.fits(c)]
    model.eval()
    start = time.perf_counter()
    videos = generate(model, captions, seeds=list(range(len(captions))), steps=args.sample_steps)
    paths = write_clips(list(videos), out / "samples")
    log(f"samples ({len(captions)} captions, {time.perf_counter() - start:.1f}s): {', '.join(p.name for p in paths)}")
    log_file.close()
    return 0
