"""Command line: ``python -m sparsevid <command>``. Each command lives in its own module here and
exposes ``add_parser(subparsers)``, which registers its arguments and sets ``func`` to run it; a user
mistake raises :class:`~sparsevid.cli.args.CommandError` (or fails argument parsing) and ends the run with
one ``error: ...`` line and exit status 2."""
from __future__ import annotations

import argparse
import importlib
import sys

from .args import CommandError

COMMAND_MODULES = ("demo", "train", "eval", "distill", "compare", "export_student")

DESCRIPTION = """\
sparsevid makes video diffusion transformers faster with block-sparse attention: before each attention
call it predicts which tiles of the attention map matter and computes only those. These commands run it
on the small video model that ships with the package, whose captions read like "big red plain circle
moving right on a black background"."""

EPILOG = """\
Run `python -m sparsevid COMMAND --help` for the options of a command. Sparse attention is fast on CUDA
GPUs (Triton kernels); on the CPU it runs a plain-PyTorch backend that is slower than dense attention."""


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's help ends with its default, unless the default is None (the help then says what
    happens without the option)."""

    def _get_help_string(self, action):
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


class OverviewFormatter(argparse.RawDescriptionHelpFormatter, HelpFormatter):
    """The top-level help: its description and epilog keep their line breaks."""


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (``error: ...``, exit status 2)."""

    def __init__(self, *args, formatter_class=HelpFormatter, **kwargs):
        super().__init__(*args, formatter_class=formatter_class, **kwargs)

    def error(self, message: str):
        self.exit(2, f"error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="sparsevid", description=DESCRIPTION, epilog=EPILOG, formatter_class=OverviewFormatter)
    subparsers = parser.add_subparsers(dest="command", required=True, title="commands", metavar="COMMAND",
                                       parser_class=Parser)
    for name in COMMAND_MODULES:
        importlib.import_module(f"{__name__}.{name}").add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except CommandError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
