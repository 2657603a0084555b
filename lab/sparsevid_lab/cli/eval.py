"""``python -m sparsevid_lab eval``: the quality yardsticks. Samples fixed captions and seeds with dense attention
and with each sparse configuration, and reports sparsity, PSNR/SSIM against dense beside the noise floor (dense through
the sparse kernel with every tile kept), caption faithfulness, velocity error and held-out flow-matching loss
per noise level, predicted and oracle attention recall per layer, and wall time (Markdown tables, JSON, PNG
plots)."""
from __future__ import annotations

from sparsevid.cli.args import CommandError, config_spec_arg, default_device, device_arg, positive_int_arg, sparsity_arg

from .args import add_slice_arguments, clip_arg, model_dir_arg, slice_options

DEFAULT_CONFIGS = ("rule=hybrid,topk=0.05,topp=0.9", "rule=topk,topk=0.1", "rule=topk,topk=0.25")
SMOKE_TEST_NOTE = ("NOTE: --tiny evaluates an untrained tiny model: this is a smoke test of the pipeline and its "
                   "numbers mean nothing about the quality of sparse attention.")


def add_parser(subparsers) -> None:
    from sparsevid.eval.oracle import ORACLE_SPARSITIES

    p = subparsers.add_parser(
        "eval", help="Compare sparse attention configurations with dense sampling.",
        description="Sample the built-in model's clips densely and under sparse attention configurations and compare "
                    "them: sparsity, PSNR / SSIM against the dense clips, caption faithfulness, velocity error and "
                    "held-out loss, oracle and predicted recall per layer (results.json, results.md and figures).")
    p.add_argument("--config", type=config_spec_arg, action="append", default=None, metavar="SPEC",
                   help="a sparse configuration, 'key=value,...' of SparseConfig fields (e.g. "
                        "'rule=hybrid,topk=0.05,topp=0.9,dense_steps=2') or a JSON file; repeatable "
                        f"(default: {'; '.join(DEFAULT_CONFIGS)} unless --rules-at is given)")
    p.add_argument("--rules-at", type=sparsity_arg, nargs="+", default=None, metavar="SPARSITY",
                   help="also evaluate top-k, top-p and hybrid calibrated to reach these sparsities on the "
                        "model's own attention (e.g. 0.75 0.9 0.95)")
    p.add_argument("--captions", type=positive_int_arg, default=4, help="how many of the fixed captions to use")
    p.add_argument("--caption", action="append", default=None, help="use this caption instead (repeatable)")
    p.add_argument("--held-out", type=positive_int_arg, default=None, metavar="N",
                   help="use N captions that the fine-tuning slice given by --max-objects, --backgrounds, --colours "
                        "and --motions cannot draw (the captions a student fine-tuned on that slice never saw)")
    add_slice_arguments(p, "with --held-out: the fine-tuning slice, clips")
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help="noise seeds: one clip per caption and seed")
    p.add_argument("--steps", type=positive_int_arg, default=None, help="sampler steps (default: the model's)")
    p.add_argument("--guidance", type=float, default=None,
                   help="classifier-free guidance scale (default: the model's)")
    p.add_argument("--probe-steps", type=int, nargs="*", default=None,
                   help="denoising steps probed for recall / relative L1 (default: first, middle, last)")
    p.add_argument("--probe-clips", type=int, default=1, help="how many clips are probed")
    p.add_argument("--oracle-sparsity", type=sparsity_arg, nargs="+", default=list(ORACLE_SPARSITIES),
                   help="the sparsity grid of the oracle recall")
    p.add_argument("--heldout-per-bin", type=positive_int_arg, default=8,
                   help="held-out (clip, noise, t) triples per noise-level bin (velocity error, held-out loss)")
    p.add_argument("--noise-bins", type=positive_int_arg, default=5, help="noise-level bins of [0, 1]")
    p.add_argument("--clip", type=clip_arg, default=None, metavar="T,H,W",
                   help="clip frames, height, width (default: the model's own)")
    p.add_argument("--model", type=model_dir_arg, default=None, help="model directory (default: the shipped model)")
    p.add_argument("--reference", type=model_dir_arg, default=None,
                   help="model directory whose dense velocity the velocity error is measured against "
                        "(default: the evaluated model itself)")
    p.add_argument("--tiny", action="store_true", help="an untrained tiny model instead (smoke test)")
    p.add_argument("--device", type=device_arg, default=default_device(), help="where to run: cpu, cuda or cuda:N")
    p.add_argument("--out", default="outputs/eval", help="output directory")
    p.set_defaults(func=run)


def _held_out(args, model) -> list[str]:
    """--held-out N captions of the model's scenes that the slice of the slice options cannot draw."""
    from ..data import ProceduralVideos, held_out_captions

    if args.caption:
        raise CommandError("give --caption or --held-out, not both")
    words = slice_options(args)
    if not words:
        raise CommandError("--held-out needs the fine-tuning slice: --max-objects, --backgrounds, --colours or "
                           "--motions")
    try:
        return held_out_captions(model.data, ProceduralVideos(**{**model.data.config(), **words}), args.held_out)
    except ValueError as error:
        raise CommandError(f"--held-out: {error}") from None


def run(args) -> int:
    from sparsevid.plan import parse_config
    from ..eval.harness import DEFAULT_CAPTIONS
    from ..eval.plots import plot_suite
    from ..eval.suite import run_suite, suite_table
    from ..model.builtin import load_builtin
    from .demo import load_model
    from .reports import save_report

    if args.tiny:
        print(SMOKE_TEST_NOTE)
    specs = args.config or ([] if args.rules_at else list(DEFAULT_CONFIGS))
    configs = {spec: parse_config(spec) for spec in specs}
    if not 1 <= args.captions <= len(DEFAULT_CAPTIONS):
        raise ValueError(f"--captions must be in [1, {len(DEFAULT_CAPTIONS)}], got {args.captions}")
    model = load_model(args)
    captions = args.caption or [c for c in DEFAULT_CAPTIONS if model.data.fits(c)]
    captions = captions[: args.captions] if not args.caption else captions
    if args.held_out is not None:
        captions = _held_out(args, model)
    elif slice_options(args):
        raise CommandError("--max-objects, --backgrounds, --colours and --motions describe the slice whose captions "
                           "--held-out leaves out: give --held-out N too")
    steps = args.steps or model.config["sampling"]["steps"]
    if args.rules_at:
        from ..eval.recording import rules_at_sparsity

        configs.update(rules_at_sparsity(model, args.rules_at, captions[0], args.seeds[0], steps=steps,
                                         guidance=args.guidance))
    param = next(model.parameters())
    reference = (load_builtin(args.reference, device=param.device, dtype=param.dtype)
                 if args.reference is not None else None)
    results = run_suite(model, configs, captions=captions, seeds=args.seeds, steps=steps, guidance=args.guidance,
                        probe_steps=args.probe_steps, probe_clips=args.probe_clips,
                        heldout_per_bin=args.heldout_per_bin, noise_bins=args.noise_bins,
                        oracle_sparsities=args.oracle_sparsity, reference=reference)
    results["settings"].update(smoke_test=bool(args.tiny), model=args.model or ("tiny" if args.tiny else "shipped"),
                               clip=list(model.clip_shape[1:]),
                               reference=args.reference)
    save_report(results, suite_table(results, smoke_test=args.tiny), args.out,
                "dense, then each configuration in order, then every tile kept")
    paths = plot_suite(results, args.out)
    print("wrote " + ", ".join(str(p) for p in paths))
    if args.tiny:
        print(SMOKE_TEST_NOTE)
    return 0
