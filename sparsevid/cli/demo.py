"""``sparsevid demo``: the built-in video DiT generates a clip with dense and with sparse attention;
prints sparsity, speed and similarity, and writes the two clips side by side (GIF + PNG strip)."""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from .args import (check_caption_fits, check_caption_words, default_device, device_arg, fraction_arg,
                   model_dir_arg, positive_int_arg, topk_arg)

DEFAULT_CAPTION = "big green striped square moving left and small magenta plain circle moving up on a beige background"


def add_parser(subparsers) -> None:
    summary = ("Generate one clip with dense and with sparse attention, print the sparsity, the time and how "
               "close the two clips are, and write them side by side (GIF and PNG).")
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
    p.add_argument("--rule", default="hybrid", choices=("topk", "topp", "hybrid"),
                   help="how each row of attention tiles is chosen: the top-k blocks, the blocks holding top-p "
                        "of the pooled attention mass, or the union of both")
    p.add_argument("--topk", type=topk_arg, default=0.05,
                   help="key blocks kept per query block: a fraction in (0, 1] such as 0.05, or a whole count "
                        "such as 2")
    p.add_argument("--topp", type=fraction_arg, default=0.9,
                   help="share of each row's pooled attention mass to keep, in (0, 1]")
    p.add_argument("--model", type=model_dir_arg, default=None,
                   help="directory with builtin.safetensors and builtin.json, as `sparsevid train` or "
                        "`sparsevid distill` write (without it: the shipped model)")
    p.add_argument("--tiny", action="store_true", help="use an untrained tiny model instead (a quick smoke test)")
    p.add_argument("--device", type=device_arg, default=default_device(),
                   help="where to run: cpu, cuda or cuda:N")
    p.add_argument("--out", default="outputs/demo", help="output directory")
    p.set_defaults(func=run)


def load_model(args):
    """The model named by ``--model`` / ``--tiny`` (shipped weights by default), on ``--device``.
    GPUs run it in bf16 (sparse attention then uses the Triton kernels), the CPU in fp32."""
    from ..models.builtin import BuiltinVideoDiT, load_builtin, tiny_config

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.tiny:
        torch.manual_seed(0)
        return BuiltinVideoDiT(tiny_config()).to(device, dtype).eval()
    return load_builtin(args.model, device=device, dtype=dtype)


def run(args) -> int:
    from ..eval.harness import run_harness
    from ..eval.media import write_clips
    from ..schedules import SparseConfig

    check_caption_words(args.caption)
    start = time.perf_counter()
    model = load_model(args)
    check_caption_fits(model, args.caption)
    config = SparseConfig(rule=args.rule, topk=args.topk, topp=args.topp)
    label = f"{args.rule} topk={args.topk} topp={args.topp}"
    patch = model.transformer.config.patch_size
    grid = [s // p for s, p in zip(model.clip_shape[1:], patch)]
    print(f"built-in video DiT: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, "
          f"{grid[0]}x{grid[1]}x{grid[2]} = {grid[0] * grid[1] * grid[2]} tokens per clip, "
          f"device {args.device} ({next(model.parameters()).dtype}), loaded in {time.perf_counter() - start:.1f}s")
    print(f"caption: {args.caption!r}, seed {args.seed}")
    results = run_harness(model, {label: config}, captions=[args.caption], seeds=[args.seed], steps=args.steps
                          or model.config["sampling"]["steps"], guidance=args.guidance, probe_clips=0,
                          progress=True)
    r = results["configs"][label]
    dense_s = results["dense"]["seconds"]
    print(f"dense attention : {dense_s:6.1f} s")
    print(f"sparse ({label}): {r['seconds']:6.1f} s  ({r['speedup']:.2f}x vs dense), "
          f"attention sparsity {r['sparsity']:.1%}")
    print(f"similarity of the sparse clip to the dense clip: PSNR {r['psnr']:.2f} dB, SSIM {r['ssim']:.4f}")
    if next(model.parameters()).device.type == "cpu":
        print("note: on the CPU sparse attention runs the plain-PyTorch reference backend, which computes "
              "masked dense scores, so it is slower than dense; the speed-up needs a GPU (Triton kernels).")
    out = Path(args.out)
    paths = write_clips([results["clips"]["dense"][0], results["clips"][label][0]], out / "dense_vs_sparse")
    summary = {"caption": args.caption, "seed": args.seed, "settings": results["settings"],
               "dense_seconds": dense_s, "sparse": r}
    (out / "demo.json").write_text(json.dumps(summary, indent=2))
    print("wrote " + ", ".join(str(p) for p in paths + [out / "demo.json"]) + " (left: dense, right: sparse)")
    print(f"total {time.perf_counter() - start:.1f}s")
    return 0
