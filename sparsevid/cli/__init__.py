"""Command line: ``python -m sparsevid <command>``. Each command lives in its own module here and
exposes ``add_parser(subparsers)``, which registers its arguments and sets ``func`` to run it."""
from __future__ import annotations

import argparse
import importlib

COMMAND_MODULES = ("demo", "train", "eval", "distill", "compare")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sparsevid", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(f"{__name__}.{name}").add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)
