"""``sparsevid demo``: the built-in video DiT generates one clip densely and under a sparse attention setting;
prints the wall and attention time of each run, the speed-ups, the sparsity and the similarity to the dense
clip, and writes the clips side by side, each labelled, with the caption above (GIF + PNG strip)."""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from .args import (CommandError, check_caption_fits, check_caption_words, clip_arg, default_device, device_arg, fraction_arg,
                   model_dir_arg, positive_int_arg, topk_arg)

DEFAULT_CAPTION = "big green striped square moving left and small magenta plain circle moving up on a beige background"
DENSE = "dense"
# The default sparse setting, chosen from measured demo runs on a 2-core CPU (docs/builtin_model.md, "Demo"):
# top-k 0.25 (75% sparsity) ran 1.8x faster than dense with SSIM 0.65; hybrid 0.05 / 0.9 (45%) was no faster.
DEFAULT_RULE, DEFAULT_TOPK, DEFAULT_TOPP = "topk", 0.25, 0.9
MEANING = ("wall s: the whole generation; attention s: its self-attention calls (mask prediction included); "
           "speed-up: dense time / this run's time (above 1 = faster); sparsity: share of attention tiles "
           "skipped; PSNR / SSIM: closeness to the dense clip of the same noise (higher = closer, SSIM 1 = identical); "
           "faithful: how well the clip shows its caption, read back from the pixels (0 to 1).")


def add_parser(subparsers) -> None:
    summary = ("Generate one clip with dense and with sparse attention, print the time, the sparsity and how "
               "close the two clips are, and write them side by side, labelled (GIF and PNG).")
    p = subparsers.add_parser("demo", description=summary,
                              help="Generate a clip with dense and with sparse attention and compare the two.")
    p.add_argument("--caption", default=DEFAULT_CAPTION,
                   help="what the clip shows, in the built-in caption grammar: '<size> <colour> <texture> <shape> "
                        "<motion> [and <object>...] on a <background> background'")
    p.add_argument("--seed", type=int, default=0, help="seed of the initial noise")
    p.add_argument("--steps", type=positive_int_arg, default=None,
                   help="sampler steps (without it: the model's own, 10 for the shipped model)")
    p.add_argument("--guidance", type=float, default=None,
                   help="classifier-free guidance scale (without it: the model's own)")
    p.add_argument("--rule", default=DEFAULT_RULE, choices=("topk", "topp", "hybrid"),
                   help="how each row of attention tiles is chosen: the top-k blocks, the blocks holding top-p "
                        "of the pooled attention mass, or the union of both")
    p.add_argument("--topk", type=topk_arg, default=DEFAULT_TOPK,
                   help="key blocks kept per query block: a fraction in (0, 1] such as 0.05, or a whole count "
                        "such as 2")
    p.add_argument("--topp", type=fraction_arg, default=DEFAULT_TOPP,
                   help="share of each row's pooled attention mass to keep, in (0, 1]")
    p.add_argument("--clip", type=clip_arg, default=None, metavar="T,H,W",
                   help="clip frames, height, width (default: the model's own)")
    p.add_argument("--model", type=model_dir_arg, default=None,
                   help="directory with builtin.safetensors and builtin.json, as `sparsevid train` or "
                        "`sparsevid distill` write (without it: the shipped model)")
    p.add_argument("--tiny", action="store_true", help="use an untrained tiny model instead (a quick smoke test)")
    p.add_argument("--device", type=device_arg, default=default_device(),
                   help="where to run: cpu, cuda or cuda:N")
    p.add_argument("--out", default="outputs/demo", help="output directory")
    p.set_defaults(func=run)


def load_model(args):
    """The model named by ``--model`` / ``--tiny`` (shipped weights by default), on ``--device``, making clips of
    ``--clip`` (default: the model's own shape). GPUs run it in bf16 (sparse attention then uses the Triton
    kernels), the CPU in fp32 (the gather backend)."""
    from ..models.builtin import BuiltinVideoDiT, load_builtin, tiny_config

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.tiny:
        torch.manual_seed(0)
        model = BuiltinVideoDiT(tiny_config()).to(device, dtype).eval()
    else:
        model = load_builtin(args.model, device=device, dtype=dtype)
    if args.clip is not None:
        try:
            model.use_clip(*args.clip)
        except ValueError as error:
            raise CommandError(f"--clip: {error}") from None
    return model


def demo_settings(args, steps: int) -> dict:
    """{label: SparseConfig} of the runs, dense first. "dense" runs every step dense through the sparse
    processors (the unmodified model's computation), so its attention is timed like the sparse runs'."""
    from ..schedules import SparseConfig

    sparse = SparseConfig(rule=args.rule, topk=args.topk, topp=args.topp)
    return {DENSE: SparseConfig(dense_steps=steps), f"sparse {args.rule}": sparse}


def run_settings(model, settings: dict, caption: str, seed: int, steps: int, guidance: float | None) -> dict:
    """Sample the caption once per setting (a per-step progress bar each, after a one-step warm-up): per label
    the clip float32 [3, T, H, W], wall and attention seconds, mean sparsity, speed-ups, PSNR / SSIM against
    the dense clip and the clip's caption faithfulness (``sparsevid.eval.faithfulness``, overall in [0, 1])."""
    from ..eval.faithfulness import faithfulness
    from ..eval.harness import sample_with_stats, summarize_calls
    from ..eval.video_metrics import psnr, ssim

    jobs = [(caption, seed)]
    sample_with_stats(model, list(settings.values())[-1], jobs, 1, guidance)  # warm-up: first calls are slow
    runs = {}
    for label, config in settings.items():
        clips, seconds, calls = sample_with_stats(model, config, jobs, steps, guidance, progress=label)
        runs[label] = {"config": config.to_dict(), "seconds": seconds, **summarize_calls(calls), "clip": clips}
    dense = runs[DENSE]
    for r in runs.values():
        r["speedup"] = dense["seconds"] / r["seconds"]
        r["attention_speedup"] = dense["attention_s"] / r["attention_s"]
        r["psnr"], r["ssim"] = float(psnr(r["clip"], dense["clip"])[0]), float(ssim(r["clip"], dense["clip"])[0])
        r["faithfulness"] = faithfulness(r["clip"].float(), [caption])[0]["overall"]
    for r in runs.values():
        r["clip"] = r["clip"][0]
    return runs


def print_table(runs: dict) -> None:
    print(f"{'setting':<16} {'wall s':>7} {'attention s':>11} {'speed-up wall / attention':>26} "
          f"{'sparsity':>8} {'PSNR dB':>8} {'SSIM':>7} {'faithful':>8}")
    for label, r in runs.items():
        speedup = f"{r['speedup']:.2f}x / {r['attention_speedup']:.2f}x"
        print(f"{label:<16} {r['seconds']:7.1f} {r['attention_s']:11.1f} {speedup:>26} {r['sparsity']:8.1%} "
              f"{r['psnr']:8.2f} {r['ssim']:7.4f} {r['faithfulness']:8.2f}")
    print(MEANING)


def clip_label(label: str, sparsity: float) -> str:
    return label if label == DENSE else f"{label} {sparsity:.0%}"


def run(args) -> int:
    from ..eval.media import write_clips

    check_caption_words(args.caption)
    start = time.perf_counter()
    model = load_model(args)
    check_caption_fits(model, args.caption)
    steps = args.steps or model.config["sampling"]["steps"]
    settings = demo_settings(args, steps)
    patch = model.transformer.config.patch_size
    grid = [s // p for s, p in zip(model.clip_shape[1:], patch)]
    device = next(model.parameters()).device
    backend = "Triton kernels" if device.type == "cuda" else "gather backend (kept tiles only)"
    print(f"built-in video DiT: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, "
          f"{grid[0]}x{grid[1]}x{grid[2]} = {grid[0] * grid[1] * grid[2]} tokens per clip, "
          f"device {args.device} ({next(model.parameters()).dtype}, {torch.get_num_threads()} threads), "
          f"sparse attention by the {backend}; loaded in {time.perf_counter() - start:.1f}s")
    print(f"caption: {args.caption!r}, seed {args.seed}, {steps} steps")
    runs = run_settings(model, settings, args.caption, args.seed, steps, args.guidance)
    print_table(runs)
    out = Path(args.out)
    paths = write_clips([r["clip"] for r in runs.values()], out / "dense_vs_sparse",
                        labels=[clip_label(label, r["sparsity"]) for label, r in runs.items()], caption=args.caption)
    summary = {"caption": args.caption, "seed": args.seed,
               "settings": {"steps": steps, "guidance": args.guidance or model.config["sampling"]["guidance"],
                            "device": str(device),
                            "threads": torch.get_num_threads()},
               "runs": {label: {k: v for k, v in r.items() if k != "clip"} for label, r in runs.items()}}
    (out / "demo.json").write_text(json.dumps(summary, indent=2))
    print("wrote " + ", ".join(str(p) for p in paths + [out / "demo.json"]))
    print(f"total {time.perf_counter() - start:.1f}s")
    return 0
