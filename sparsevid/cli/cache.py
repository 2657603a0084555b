"""``sparsevid cache``: encode videos with captions (or clips sampled from the model) into a latent shard folder
with a diffusers pipeline's own VAE and text encoder."""
from __future__ import annotations

from .args import CommandError, default_device, device_arg, positive_float_arg, positive_int_arg

DTYPES = ("float32", "bfloat16", "float16")


def add_parser(subparsers) -> None:
    summary = ("Encode a folder of videos with captions (mp4/webm/gif files or folders of frames, each with a .txt "
               "beside it or rows of a CSV/JSONL manifest) with a diffusers pipeline's own VAE and text encoder into "
               "safetensors shards with an index (sparsevid.training.latents), which `sparsevid distill --data` "
               "reads; or, with --synthetic N, sample N clips from the pipeline itself. Resumable: a second run "
               "into the same --out encodes only what is missing. Items that cannot be used are reported, listed "
               "under 'skipped' in the index with their reasons, and left out.")
    p = subparsers.add_parser("cache", description=summary, help="Encode videos (or sampled clips) into latents.")
    p.add_argument("--pipeline", required=True, help="the diffusers pipeline: a folder or a hub id (Wan, HunyuanVideo or LTX-Video pipelines)")
    p.add_argument("--out", required=True, help="the shard folder to write (or to continue)")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--videos", help="folder of videos or frame folders with captions")
    source.add_argument("--synthetic", type=positive_int_arg, metavar="N",
                        help="sample N clips from the pipeline itself (needs --prompts, --height, --width, --frames)")
    p.add_argument("--captions", help="manifest (.csv or .jsonl with video, caption and optionally fps fields) "
                                      "instead of .txt files beside the videos")
    p.add_argument("--prompts", help="with --synthetic: a text file of prompts, one per line (used in turn)")
    p.add_argument("--height", type=positive_int_arg, help="clip height in pixels (scale and centre crop; without "
                                                           "it each clip keeps its own size, cropped to fit)")
    p.add_argument("--width", type=positive_int_arg, help="clip width in pixels (with --height)")
    p.add_argument("--frames", type=positive_int_arg,
                   help="frames per clip, k * (the VAE's temporal factor) + 1, e.g. k * 4 + 1 for Wan (without it: as "
                        "many as each clip has that fit)")
    p.add_argument("--fps", type=positive_float_arg, help="resample clips to this frame rate (without it: their own)")
    p.add_argument("--steps", type=positive_int_arg, default=50, help="with --synthetic: sampling steps")
    p.add_argument("--guidance", type=float, default=None,
                   help="with --synthetic: the pipeline's guidance_scale (classifier-free guidance; HunyuanVideo's "
                        "embedded guidance). Default: 1, unguided (the distribution the model learned, one transformer "
                        "call per step; guided samples made worse students, docs/distillation.md), or for a "
                        "guidance-distilled transformer (HunyuanVideo) the pipeline's own default")
    p.add_argument("--seed", type=int, default=0, help="with --synthetic: seed of the clips' noise")
    p.add_argument("--batch-size", type=positive_int_arg, default=1,
                   help="with --synthetic: clips sampled per pipeline call (the clips do not depend on it)")
    p.add_argument("--shard-size", type=positive_int_arg, default=16, help="samples per shard file")
    p.add_argument("--device", type=device_arg, default=default_device(), help="cpu, cuda or cuda:N")
    p.add_argument("--dtype", choices=DTYPES, default=None,
                   help="the pipeline's precision (default: bfloat16 on a GPU, float32 on the CPU)")
    p.set_defaults(func=run)


def run(args) -> int:
    import torch

    from ..data import cache_synthetic, cache_videos, find_videos, load_encoder

    if args.synthetic is not None and (args.prompts is None or None in (args.height, args.width, args.frames)):
        raise CommandError("--synthetic needs --prompts, --height, --width and --frames")
    if args.synthetic is None and args.prompts is not None:
        raise CommandError("--prompts goes with --synthetic (captions of --videos come from .txt files or --captions)")
    dtype = args.dtype or ("bfloat16" if torch.device(args.device).type == "cuda" else "float32")
    try:
        if args.synthetic is not None:
            prompts = [line.strip() for line in open(args.prompts, encoding="utf-8") if line.strip()]
        else:
            items = find_videos(args.videos, args.captions)
        encoder = load_encoder(args.pipeline, args.device, getattr(torch, dtype),
                               transformer=args.synthetic is not None)
        if args.synthetic is not None:
            report = cache_synthetic(encoder, prompts, args.synthetic, args.out, args.height, args.width, args.frames,
                                     args.steps, args.guidance, args.seed, args.shard_size,
                                     batch_size=args.batch_size)
        else:
            report = cache_videos(encoder, items, args.out, args.height, args.width, args.frames, args.fps,
                                  args.shard_size)
    except (OSError, TypeError, ValueError) as error:
        raise CommandError(str(error)) from None
    print(f"{report.written} clips encoded in {report.seconds:.1f} s ({report.clips_per_second:.2f} clips/s); "
          f"{report.total} in {args.out}, {len(report.skipped)} skipped")
    return 0
