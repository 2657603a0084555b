"""``python -m sparsevid_lab compare``: sparse students (student folders, shipped or written by ``distill``) and
training-free sparse configurations against the dense reference model, by PSNR / SSIM of clips sampled from the
same captions and seeds (Markdown table + JSON)."""
from __future__ import annotations

import argparse

from sparsevid.cli.args import CommandError, config_spec_arg, default_device, device_arg, positive_int_arg

from .args import clip_arg, model_dir_arg, student_dir_arg


def add_parser(subparsers) -> None:
    summary = ("Compare distilled sparse students (`python -m sparsevid_lab distill` outputs) and training-free "
               "sparse settings with the dense model: PSNR and SSIM of clips sampled from the same captions and seeds, as a "
               "Markdown table and JSON.")
    p = subparsers.add_parser("compare", description=summary,
                              help="Compare distilled students and training-free sparse settings with the dense model.")
    p.add_argument("--student", type=student_arg, action="append", default=[], metavar="LABEL=DIR",
                   help="a sparse student and its label: a student folder (student.json and student.safetensors, as "
                        "`python -m sparsevid_lab distill` writes them; checked against the reference model's "
                        "weights); repeatable")
    p.add_argument("--training-free", type=config_spec_arg, action="append", default=[], metavar="SPEC",
                   help="a sparse setting applied to the dense model without training, SparseConfig fields as "
                        "'key=value,...' or a JSON file; repeatable")
    p.add_argument("--clip", type=clip_arg, default=None, metavar="T,H,W",
                   help="clip frames, height, width (default: the model's own)")
    p.add_argument("--model", type=model_dir_arg, default=None,
                   help="the dense reference model's directory (without it: the shipped model)")
    p.add_argument("--tiny", action="store_true", help="use an untrained tiny reference instead (a quick smoke test)")
    p.add_argument("--captions", type=positive_int_arg, default=4, help="how many of the fixed captions to sample")
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help="noise seeds; every caption with every seed")
    p.add_argument("--steps", type=positive_int_arg, default=None,
                   help="sampler steps (without it: the model's own)")
    p.add_argument("--guidance", type=float, default=None,
                   help="classifier-free guidance scale (without it: the model's own)")
    p.add_argument("--device", type=device_arg, default=default_device(), help="where to run: cpu, cuda or cuda:N")
    p.add_argument("--out", default="outputs/compare", help="output directory")
    p.set_defaults(func=run)


def student_arg(spec: str) -> str:
    """``--student``: LABEL=DIR, DIR a student folder."""
    label, sep, directory = spec.partition("=")
    if not sep or not label or not directory:
        raise argparse.ArgumentTypeError(f"expected LABEL=DIR, got {spec!r}")
    student_dir_arg(directory)
    return spec


def _student(spec: str, reference):
    """(label, (model, SparseConfig)) of a --student LABEL=DIR, on the reference's device and dtype, making
    clips of the reference's shape."""
    from .students import read_student_like

    label, _, directory = spec.partition("=")  # checked by student_arg
    try:
        return label, read_student_like(directory, reference)
    except ValueError as error:
        raise CommandError(f"--student {label}: {error}") from None


def run(args) -> int:
    from ..eval.compare import compare_to_reference, comparison_table
    from sparsevid.plan import parse_config
    from ..eval.harness import DEFAULT_CAPTIONS
    from .demo import load_model, model_record
    from .reports import save_report

    if not args.student and not args.training_free:
        raise CommandError("give at least one --student or --training-free configuration to compare")
    if args.captions > len(DEFAULT_CAPTIONS):
        raise CommandError(f"--captions must be at most {len(DEFAULT_CAPTIONS)}, got {args.captions}")
    reference = load_model(args)
    candidates = dict(_student(spec, reference) for spec in args.student)
    candidates.update({f"training-free {spec}": (reference, parse_config(spec)) for spec in args.training_free})
    captions = [c for c in DEFAULT_CAPTIONS if reference.data.fits(c)][: args.captions]
    results = compare_to_reference(reference, candidates, captions, args.seeds, steps=args.steps,
                                   guidance=args.guidance)
    sampling = reference.config["sampling"]
    results["settings"] = {**model_record(args, reference), "steps": args.steps or sampling["steps"],
                           "guidance": sampling["guidance"] if args.guidance is None else args.guidance,
                           "captions": captions, "seeds": args.seeds}
    save_report(results, comparison_table(results), args.out, "reference, then each candidate in order")
    return 0
