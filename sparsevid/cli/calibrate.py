"""``sparsevid calibrate``: choose each head's sparse setting from the dense model's own attention, once, and save
the choice beside the model (``SparseConfig.from_calibration`` loads it)."""
from __future__ import annotations

import time
from pathlib import Path

from .args import (CommandError, add_calibration_objective, add_noise_range_option, default_device, device_arg,
                   positive_int_arg)

CALIBRATION_FILE = "sparse_calibration.json"
# --prompts N: scenes of different motion, layout and detail, so that the heads meet the attention of varied videos.
CALIBRATION_PROMPTS = (
    "A golden retriever runs across a sunlit meadow, the camera tracking it at ground level",
    "Waves crash against black volcanic rocks at dusk, spray drifting in slow motion",
    "A busy city crossing seen from above, cars and pedestrians moving in every direction",
    "Close-up of hands kneading dough on a floured wooden table, soft window light",
    "A drone shot flying low over a winding river through an autumn forest",
    "A dancer in a red dress spins on an empty stage under a single spotlight",
    "Snow falls steadily on a quiet mountain village at night, warm lights in the windows",
    "A chef flips vegetables in a flaming wok in a crowded restaurant kitchen",
)


def add_parser(subparsers) -> None:
    summary = ("Run the dense transformer on a few inputs, measure every self-attention head under candidate "
               "settings (top-k fractions, top-p masses, dense: the sparsity each reaches and the relative L1 error "
               "of its attention output), and choose each head's setting: the least summed error at a mean target "
               "sparsity (--target-sparsity), or the sparsest setting within an error bound per head (--max-error). "
               "Writes the calibration (JSON) beside the model, a summary table and a layer x head heat map; load it "
               "with sparsevid.SparseConfig.from_calibration(path). Every supported family (joint text-video "
               "attention: the video rows' output with their dense text keys).")
    p = subparsers.add_parser("calibrate", description=summary, help="Per-layer, per-head sparsity from the model.")
    p.add_argument("--model", required=True, help="the dense model: a pipeline or transformer folder, or a hub id "
                                                  "(--prompts needs a pipeline)")
    inputs = p.add_mutually_exclusive_group(required=True)
    inputs.add_argument("--prompts", help="a text file of prompts, one per line, or a number N: the first N of "
                                          f"{len(CALIBRATION_PROMPTS)} varied built-in prompts; each is sampled by the "
                                          "pipeline (needs --height, --width, --frames) and every denoising step "
                                          "measured")
    inputs.add_argument("--data", help="a folder of cached latents (`sparsevid cache`): forwards at stratified noise "
                                       "levels")
    add_calibration_objective(p)
    p.add_argument("--out", help=f"the calibration file (default: {CALIBRATION_FILE} in the --model folder)")
    p.add_argument("--plot", help="the heat map PNG (default: the --out path with .png)")
    p.add_argument("--block-q", type=int, choices=(64, 128), default=128, help="query tile size")
    p.add_argument("--block-k", type=int, choices=(64, 128), default=64, help="key tile size")
    p.add_argument("--tile", default="auto", help="token order of the masks: auto, none or T,H,W")
    p.add_argument("--per-bin", type=positive_int_arg, default=2, help="--data: triples per noise-level bin")
    p.add_argument("--bins", type=positive_int_arg, default=3, help="--data: noise-level bins")
    add_noise_range_option(p, "--data: the noise levels t the triples span (default 0,1); e.g. for Wan2.2 A14B's "
                              "experts (boundary 0.875) 0.875,1 for PIPELINE/transformer and 0,0.875 for "
                              "PIPELINE/transformer_2")
    p.add_argument("--height", type=positive_int_arg, help="--prompts: clip height in pixels")
    p.add_argument("--width", type=positive_int_arg, help="--prompts: clip width in pixels")
    p.add_argument("--frames", type=positive_int_arg, help="--prompts: clip frames")
    p.add_argument("--steps", type=positive_int_arg, default=10, help="--prompts: sampling steps")
    p.add_argument("--guidance", type=float, default=5.0, help="--prompts: classifier-free guidance scale")
    p.add_argument("--seed", type=int, default=0, help="--prompts: seed of the clips' noise")
    p.add_argument("--device", type=device_arg, default=default_device(), help="cpu, cuda or cuda:N")
    p.set_defaults(func=run)


def _tile(text: str):
    if text in ("auto", "none"):
        return text
    try:
        tile = tuple(int(x) for x in text.split(","))
    except ValueError:
        tile = ()
    if len(tile) != 3 or min(tile) < 1:
        raise CommandError(f"--tile must be auto, none or T,H,W (three whole numbers >= 1), got {text!r}")
    return tile


def _out_path(args) -> Path:
    if args.out is not None:
        return Path(args.out)
    if not Path(args.model).is_dir():
        raise CommandError("--model is not a folder: give --out")
    return Path(args.model) / CALIBRATION_FILE


def _data_forwards(args, transformer, device, dtype):
    """(forwards, description): one dense forward per held-out triple of the --data folder."""
    import torch

    from ..eval.velocity import heldout_set
    from ..training import LatentDirectory
    from ..training.velocity import predict_velocity

    heldout = heldout_set(LatentDirectory(args.data), args.per_bin, args.bins, noise_range=args.noise_range)

    def forward(i: int):
        index = torch.tensor([i])
        t, level = heldout.t[index], heldout.t[index].view(-1, 1, 1, 1, 1)
        x_t = (1 - level) * heldout.samples.latents[index] + level * heldout.noise[index]
        batch = heldout.samples.select(index).to(device, dtype)
        return predict_velocity(transformer, x_t.to(device, dtype), t.to(device, dtype), batch)

    return [lambda i=i: forward(i) for i in range(len(heldout))], {"data": str(args.data), **heldout.describe()}


def _prompt_forwards(args, device, dtype):
    """({name: transformer} of the pipeline (Wan2.2's two experts: both), forwards, description): one sampling per
    prompt of the --prompts file."""
    from ..data import load_encoder
    from ..integration import pipeline_transformers
    from ..training import STREAM_TEACHER, sample_generator

    if None in (args.height, args.width, args.frames):
        raise CommandError("--prompts needs --height, --width and --frames")
    prompts = _prompts(args.prompts)
    encoder = load_encoder(args.model, device, dtype, transformer=True)
    encoder.check(args.height, args.width, args.frames)

    def sample(index: int):
        return encoder.pipe(prompt=prompts[index], height=args.height, width=args.width, num_frames=args.frames,
                            num_inference_steps=args.steps, guidance_scale=args.guidance, output_type="latent",
                            generator=sample_generator(args.seed, index, STREAM_TEACHER))

    description = {"prompts": prompts, "height": args.height, "width": args.width, "frames": args.frames,
                   "steps": args.steps, "guidance": args.guidance, "seed": args.seed}
    return pipeline_transformers(encoder.pipe), [lambda i=i: sample(i) for i in range(len(prompts))], description


def _prompts(text: str) -> list[str]:
    """The prompts of ``--prompts``: the first N built-in ones for a number N, else the file's lines."""
    if text.isdigit():
        count = int(text)
        if not 1 <= count <= len(CALIBRATION_PROMPTS):
            raise CommandError(f"--prompts {text}: give 1 to {len(CALIBRATION_PROMPTS)} built-in prompts, or a file")
        return list(CALIBRATION_PROMPTS[:count])
    prompts = [line.strip() for line in Path(text).read_text(encoding="utf-8").splitlines() if line.strip()]
    if not prompts:
        raise CommandError(f"--prompts {text}: no prompts (one per line)")
    return prompts


def _beside(path: Path, name: str) -> Path:
    """Where the file of transformer ``name`` goes: ``path`` for the pipeline's ``transformer``, else beside it with
    the name added (``sparse_calibration_transformer_2.json``)."""
    return path if name == "transformer" else path.with_name(f"{path.stem}_{name}{path.suffix}")


def run(args) -> int:
    import torch
    from tqdm import tqdm

    from ..eval.calibrate import calibrate_transformers, calibration_table, plot_calibration
    from ..integration import load_transformer

    tile = _tile(args.tile)
    out = _out_path(args)
    dtype = torch.bfloat16 if torch.device(args.device).type == "cuda" else torch.float32
    start = time.perf_counter()
    try:
        if args.data is not None:
            transformers = {"transformer": load_transformer(args.model, dtype=dtype, device=args.device).eval()}
            forwards, description = _data_forwards(args, transformers["transformer"], args.device, dtype)
        else:
            transformers, forwards, description = _prompt_forwards(args, args.device, dtype)
        calibrations = calibrate_transformers(transformers, tqdm(forwards, desc="calibrate", unit="input"),
                                              block_q=args.block_q, block_k=args.block_k, tile=tile,
                                              inputs=description, noise_splits=args.noise_splits)
        for calibration in calibrations.values():
            calibration.choose(args.target_sparsity, args.max_error, args.error)
    except (FileNotFoundError, TypeError, ValueError) as error:
        raise CommandError(str(error)) from None
    seconds = round(time.perf_counter() - start, 3)
    for name, calibration in calibrations.items():
        for part in calibration.parts:
            part.inputs.update(seconds=seconds, device=str(args.device))
        path = calibration.save(_beside(out, name))
        plot = plot_calibration(calibration, _beside(Path(args.plot), name) if args.plot else path.with_suffix(".png"))
        if len(calibrations) > 1:
            print(f"{name}:")
        print(calibration_table(calibration))
        print(f"calibration written to {path} (heat map {plot}); load it with "
              f"sparsevid.SparseConfig.from_calibration({str(path)!r})")
    return 0
