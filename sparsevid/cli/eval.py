"""``sparsevid eval``: the quality harness. Samples fixed captions and seeds with dense attention and
with each sparse configuration, and reports sparsity, PSNR/SSIM against dense, per-layer attention
recall and relative L1 on the real activations, and wall time (Markdown table + JSON)."""
from __future__ import annotations

import torch

DEFAULT_CONFIGS = ("rule=hybrid,topk=0.05,topp=0.9", "rule=topk,topk=0.1", "rule=topk,topk=0.25")


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("eval", help="compare sparse attention configurations with dense sampling")
    p.add_argument("--config", action="append", default=None, metavar="SPEC",
                   help="a sparse configuration, 'key=value,...' of SparseConfig fields (e.g. "
                        "'rule=hybrid,topk=0.05,topp=0.9,dense_steps=2') or a JSON file; repeatable "
                        f"(default: {'; '.join(DEFAULT_CONFIGS)})")
    p.add_argument("--captions", type=int, default=4, help="how many of the fixed captions to use")
    p.add_argument("--caption", action="append", default=None, help="use this caption instead (repeatable)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--steps", type=int, default=None, help="sampler steps (default: the model's)")
    p.add_argument("--guidance", type=float, default=None)
    p.add_argument("--probe-steps", type=int, nargs="*", default=None,
                   help="denoising steps probed for recall / relative L1 (default: first, middle, last)")
    p.add_argument("--probe-clips", type=int, default=1, help="how many clips are probed")
    p.add_argument("--model", default=None, help="model directory (default: the shipped model)")
    p.add_argument("--tiny", action="store_true", help="an untrained tiny model instead (smoke test)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default="outputs/eval")
    p.set_defaults(func=run)


def run(args) -> int:
    from ..eval.harness import DEFAULT_CAPTIONS, markdown_table, parse_config, run_harness
    from .demo import load_model
    from .reports import save_report

    specs = args.config or list(DEFAULT_CONFIGS)
    configs = {spec: parse_config(spec) for spec in specs}
    if not 1 <= args.captions <= len(DEFAULT_CAPTIONS):
        raise ValueError(f"--captions must be in [1, {len(DEFAULT_CAPTIONS)}], got {args.captions}")
    model = load_model(args)
    captions = args.caption or [c for c in DEFAULT_CAPTIONS if model.data.fits(c)]
    captions = captions[: args.captions] if not args.caption else captions
    results = run_harness(model, configs, captions=captions, seeds=args.seeds,
                          steps=args.steps or model.config["sampling"]["steps"], guidance=args.guidance,
                          probe_steps=args.probe_steps, probe_clips=args.probe_clips)
    save_report(results, markdown_table(results), args.out, "dense, then each configuration in order")
    return 0
