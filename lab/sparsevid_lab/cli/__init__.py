"""The lab's command line: ``python -m sparsevid_lab <command>`` (the demo, training and evaluating the built-in
model, distilling and comparing its students). Commands are built like sparsevid's own (:mod:`sparsevid.cli`)."""
from __future__ import annotations

import argparse

from sparsevid.cli import build_parser as build_command_line
from sparsevid.cli import main as run_command

COMMAND_MODULES = ("demo", "train", "eval", "distill", "compare", "calibrate")

DESCRIPTION = """\
sparsevid's lab: the small video model built into the repository, whose captions read like "big red plain
circle moving right on a black background", and the measurements of block-sparse attention on it against
dense attention."""

EPILOG = """\
Run `python -m sparsevid_lab COMMAND --help` for the options of a command. The library's own commands
(fine-tuning and evaluating real diffusers models): `python -m sparsevid --help`."""


def build_parser() -> argparse.ArgumentParser:
    return build_command_line(prog="sparsevid_lab", package=__name__, commands=COMMAND_MODULES,
                              description=DESCRIPTION, epilog=EPILOG)


def main(argv: list[str] | None = None) -> int:
    return run_command(argv, build_parser())
