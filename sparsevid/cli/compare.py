"""``sparsevid compare``: sparse students (``sparsevid distill`` outputs) and training-free sparse
configurations against the dense reference model, by PSNR / SSIM of clips sampled from the same captions
and seeds (Markdown table + JSON)."""
from __future__ import annotations

from pathlib import Path

import torch


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("compare", help="compare sparse students and training-free sparse attention "
                                              "with the dense reference model")
    p.add_argument("--student", action="append", default=[], metavar="LABEL=DIR",
                   help="a distilled model directory (builtin.* + sparse_config.json); repeatable")
    p.add_argument("--training-free", action="append", default=[], metavar="SPEC",
                   help="a SparseConfig spec applied to the reference model without training; repeatable")
    p.add_argument("--model", default=None, help="the dense reference (default: the shipped model)")
    p.add_argument("--tiny", action="store_true", help="an untrained tiny reference (smoke test)")
    p.add_argument("--captions", type=int, default=4, help="how many of the harness captions")
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--steps", type=int, default=None, help="sampler steps (default: the model's)")
    p.add_argument("--guidance", type=float, default=None)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default="outputs/compare")
    p.set_defaults(func=run)


def _student(spec: str, device):
    from ..models.builtin import load_builtin
    from ..schedules import SparseConfig
    from ..training.distill import SPARSE_CONFIG_FILE

    label, sep, directory = spec.partition("=")
    if not sep or not label or not directory:
        raise ValueError(f"--student must look like LABEL=DIR, got {spec!r}")
    config_path = Path(directory) / SPARSE_CONFIG_FILE
    if not config_path.is_file():
        raise ValueError(f"--student {spec!r}: {config_path} not found (a `sparsevid distill` output directory?)")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return label, (load_builtin(directory, device=device, dtype=dtype), SparseConfig.from_json(config_path.read_text()))


def run(args) -> int:
    from ..eval.compare import compare_to_reference, comparison_table
    from ..eval.harness import DEFAULT_CAPTIONS, parse_config
    from .demo import load_model
    from .reports import save_report

    if not args.student and not args.training_free:
        raise ValueError("give at least one --student or --training-free configuration")
    if not 1 <= args.captions <= len(DEFAULT_CAPTIONS):
        raise ValueError(f"--captions must be in [1, {len(DEFAULT_CAPTIONS)}], got {args.captions}")
    reference = load_model(args)
    device = next(reference.parameters()).device
    candidates = dict(_student(spec, device) for spec in args.student)
    candidates.update({f"training-free {spec}": (reference, parse_config(spec)) for spec in args.training_free})
    captions = [c for c in DEFAULT_CAPTIONS if reference.data.fits(c)][: args.captions]
    results = compare_to_reference(reference, candidates, captions, args.seeds, steps=args.steps,
                                   guidance=args.guidance)
    save_report(results, comparison_table(results), args.out, "reference, then each candidate in order")
    return 0
