"""``python -m sparsevid_lab calibrate``: the built-in model's per-head calibration through the library's API
(``sparsevid.eval.calibrate.calibrate_heads``): its dense sampling of a few captions measured at every step."""
from __future__ import annotations

from pathlib import Path

from sparsevid.cli.args import CommandError, add_calibration_objective, default_device, device_arg, positive_int_arg

from .args import clip_arg, model_dir_arg


def calibrate_builtin(model, jobs, steps: int | None = None, guidance: float | None = None, progress: bool = True,
                      **options):
    """The :class:`~sparsevid.plan.calibration.Calibration` (no choice yet) of the built-in ``model``'s heads over
    its dense sampling of each (caption, seed) in ``jobs``; ``options``: ``calibrate_heads``'s (block_q,
    block_k, tile, backend, candidates, noise_splits: then a ``NoiseRangeCalibration``)."""
    from tqdm.auto import tqdm

    from sparsevid.eval.calibrate import calibrate_heads

    from ..model.sampling import generate

    steps = model.config["sampling"]["steps"] if steps is None else steps
    forwards = [lambda c=c, s=s: generate(model, [c], [s], steps=steps, guidance=guidance) for c, s in jobs]
    inputs = {"jobs": [list(job) for job in jobs], "steps": steps, "clip": list(model.clip_shape[1:]),
              "guidance": model.config["sampling"]["guidance"] if guidance is None else guidance}
    return calibrate_heads(model.transformer, tqdm(forwards, desc="calibrate", unit="clip", disable=not progress),
                           inputs=inputs, **options)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "calibrate", help="Per-head sparse settings of the built-in model (sparsevid calibrate on its sampling).",
        description="Sample the built-in model densely for a few captions, measure every head under top-k / top-p "
                    "candidates at every step, choose each head's setting (--target-sparsity or --max-error) and "
                    "write the calibration (JSON), its table and heat map. Load it with "
                    "sparsevid.SparseConfig.from_calibration.")
    add_calibration_objective(p)
    p.add_argument("--captions", type=positive_int_arg, default=2, help="how many of the fixed captions to sample")
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help="noise seeds: one clip per caption and seed")
    p.add_argument("--steps", type=positive_int_arg, default=None, help="sampler steps (default: the model's)")
    p.add_argument("--guidance", type=float, default=None, help="guidance scale (default: the model's)")
    p.add_argument("--block-q", type=int, choices=(64, 128), default=128, help="query tile size")
    p.add_argument("--block-k", type=int, choices=(64, 128), default=64, help="key tile size")
    p.add_argument("--clip", type=clip_arg, default=None, metavar="T,H,W", help="clip shape (default: the model's)")
    p.add_argument("--model", type=model_dir_arg, default=None, help="model directory (default: the shipped model)")
    p.add_argument("--tiny", action="store_true", help="an untrained tiny model instead (smoke test)")
    p.add_argument("--device", type=device_arg, default=default_device(), help="cpu, cuda or cuda:N")
    p.add_argument("--out", default="outputs/calibration.json", help="the calibration file (heat map beside it)")
    p.set_defaults(func=run)


def run(args) -> int:
    from sparsevid.eval.calibrate import calibration_table, plot_calibration

    from ..eval.harness import DEFAULT_CAPTIONS
    from .demo import load_model

    model = load_model(args)
    captions = [c for c in DEFAULT_CAPTIONS if model.data.fits(c)][:args.captions]
    jobs = [(c, s) for c in captions for s in args.seeds]
    try:
        calibration = calibrate_builtin(model, jobs, args.steps, args.guidance, block_q=args.block_q,
                                        block_k=args.block_k, noise_splits=args.noise_splits)
        calibration.choose(args.target_sparsity, args.max_error, args.error)
    except ValueError as error:
        raise CommandError(str(error)) from None
    out = calibration.save(Path(args.out))
    plot = plot_calibration(calibration, out.with_suffix(".png"))
    print(calibration_table(calibration))
    print(f"wrote {out} and {plot}")
    return 0
