"""Command line: ``python -m sparsevid <command>``. Each command lives in its own module here and
exposes ``add_parser(subparsers)``, which registers its arguments and sets ``func`` to run it; a user
mistake raises :class:`~sparsevid.cli.args.CommandError` (or fails argument parsing) and ends the run with
one ``error: ...`` line and exit status 2."""
from __future__ import annotations

import argparse
import importlib
import sys

from .args import CommandError

COMMAND_MODULES = ("cache", "distill", "evaluate", "calibrate")

DESCRIPTION = """\
sparsevid makes video diffusion transformers faster with block-sparse attention: before each attention
call it predicts which tiles of the attention map matter and computes only those. These commands fine-tune
a diffusers video transformer (Wan, HunyuanVideo) into a sparse student and measure it against the dense
model, on latents with their text-encoder states (a folder of samples, sparsevid.training.latents)."""

EPILOG = """\
Run `sparsevid COMMAND --help` for the options of a command. In Python, one line switches a diffusers
pipeline's transformer to sparse attention: sparsevid.apply_sparse_attention(pipe.transformer, config).
Sparse attention runs fused Triton kernels on CUDA GPUs and a gather backend on the CPU that computes only
the kept tiles: at 90% sparsity it measured 3.3-5.6x faster than dense attention forward and up to 6.8x
forward + backward on a 2-core CPU. The built-in
model's demo and studies live in the repository's lab: `python -m sparsevid_lab --help`."""


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


def build_parser(prog: str = "sparsevid", package: str = __name__, commands=COMMAND_MODULES,
                 description: str = DESCRIPTION, epilog: str = EPILOG) -> argparse.ArgumentParser:
    """The parser of a command line whose commands are the modules ``commands`` of ``package``, each with an
    ``add_parser(subparsers)``."""
    parser = Parser(prog=prog, description=description, epilog=epilog, formatter_class=OverviewFormatter)
    subparsers = parser.add_subparsers(dest="command", required=True, title="commands", metavar="COMMAND",
                                       parser_class=Parser)
    for name in commands:
        importlib.import_module(f"{package}.{name}").add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None, parser: argparse.ArgumentParser | None = None) -> int:
    """Run the command ``argv`` names (default: the command line) with ``parser`` (default: sparsevid's)."""
    args = (parser or build_parser()).parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except CommandError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
