"""``sparsevid export-student``: a finished ``sparsevid distill`` run as a small asset (its fine-tuned
tensors in bf16 and its SparseConfig), loadable with ``sparsevid.load_sparse_student``."""
from __future__ import annotations

from pathlib import Path

from .args import CommandError, model_dir_arg


def add_parser(subparsers) -> None:
    summary = ("Write the fine-tuned part of a distilled student (e.g. its attention weights with --trainable "
               "attention) and its sparse configuration as a small asset beside the dense weights; "
               "sparsevid.load_sparse_student(OUT) loads it in one call.")
    p = subparsers.add_parser("export-student", description=summary,
                              help="Write a distilled student as a small asset beside the dense weights.")
    p.add_argument("--run", type=model_dir_arg, required=True, help="the `sparsevid distill` output directory")
    p.add_argument("--out", required=True,
                   help="the asset directory; load_sparse_student takes the dense weights from its parent "
                        "directory unless given base=")
    p.add_argument("--base", type=model_dir_arg, default=None,
                   help="the dense model the student was fine-tuned from (without it: the shipped model)")
    p.set_defaults(func=run)


def run(args) -> int:
    from ..model.student_asset import export_sparse_student

    try:
        out = export_sparse_student(args.run, args.out, base=args.base)
    except (FileNotFoundError, ValueError) as error:
        raise CommandError(str(error)) from None
    size = sum(p.stat().st_size for p in Path(out).iterdir()) / 1e6
    print(f"wrote the student asset to {out} ({size:.1f} MB)")
    return 0
