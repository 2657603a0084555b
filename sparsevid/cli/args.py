"""What the commands share about their arguments: parsing helpers that reject bad values with one clear line, and
:class:`CommandError` for a user error found later (a missing file, data made for another model), which the
command line prints as ``error: ...`` and exits with status 2."""
from __future__ import annotations

import argparse

import torch

from ..plan import parse_config


class CommandError(Exception):
    """A mistake in the command line or its inputs: printed as one line, without a traceback."""


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def device_arg(text: str) -> str:
    """``--device``: a torch device name that exists on this machine."""
    try:
        parsed = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a device (use cpu, cuda or cuda:N)") from None
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(f"{text!r}: CUDA is not available on this machine (use --device cpu)")
        if parsed.index is not None and parsed.index >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(f"{text!r}: this machine has {torch.cuda.device_count()} CUDA devices")
    elif parsed.type != "cpu":
        raise argparse.ArgumentTypeError(f"{text!r}: only cpu and cuda devices are supported")
    return text


def topk_arg(text: str) -> int | float:
    """``--topk``: a whole number is a count of key blocks per row ("2"), anything else a fraction of them
    in (0, 1] ("0.05")."""
    try:
        count = int(text)
    except ValueError:
        pass
    else:
        if count < 1:
            raise argparse.ArgumentTypeError(f"a count of key blocks must be >= 1, got {text}")
        return count
    try:
        fraction = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1] or a count >= 1, got {text!r}") from None
    if not 0 < fraction <= 1:
        raise argparse.ArgumentTypeError(f"a fraction of key blocks must lie in (0, 1] (or give a whole count), "
                                         f"got {text}")
    return fraction


def number_arg(text: str, convert, valid, expected: str):
    """``convert(text)`` if it parses and ``valid`` holds, else an ArgumentTypeError saying ``expected``."""
    try:
        value = convert(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
    if not valid(value):
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text}")
    return value


def fraction_arg(text: str) -> float:
    """A float in (0, 1] (``--topp``)."""
    return number_arg(text, float, lambda v: 0 < v <= 1, "a number in (0, 1]")


def positive_int_arg(text: str) -> int:
    return number_arg(text, int, lambda v: v >= 1, "a whole number >= 1")


def noise_range_arg(text: str) -> tuple[float, float]:
    """LOW,HIGH: a range of noise levels t, 0 <= LOW < HIGH <= 1."""
    return number_arg(text, lambda t: tuple(float(x) for x in t.split(",")),
                      lambda v: len(v) == 2 and 0 <= v[0] < v[1] <= 1, "LOW,HIGH with 0 <= LOW < HIGH <= 1")


def noise_splits_arg(text: str) -> tuple[float, ...]:
    """S1,S2,...: noise levels strictly ascending within (0, 1)."""
    from ..plan.noise_ranges import check_splits

    def valid(values) -> bool:
        try:
            check_splits(values)
        except ValueError:
            return False
        return True

    return number_arg(text, lambda t: tuple(float(x) for x in t.split(",")), valid,
                      "noise levels S1,S2,... strictly ascending within (0, 1)")


def add_noise_range_option(parser: argparse.ArgumentParser, help_text: str) -> None:
    """--noise-range LOW,HIGH (default every noise level), e.g. the levels one expert of a two-expert pipeline
    serves."""
    from ..training.flow import FULL_RANGE

    parser.add_argument("--noise-range", type=noise_range_arg, default=FULL_RANGE, metavar="LOW,HIGH", help=help_text)


def sparsity_arg(text: str) -> float:
    """A sparsity: the share of attention tiles skipped, a number in [0, 1)."""
    return number_arg(text, float, lambda v: 0 <= v < 1, "a sparsity in [0, 1)")


def positive_float_arg(text: str) -> float:
    return number_arg(text, float, lambda v: v > 0, "a number > 0")


def config_spec_arg(text: str) -> str:
    """``--config``-like options: a SparseConfig as 'key=value,...' or a JSON file, checked here."""
    try:
        parse_config(text)
    except (ValueError, TypeError, OSError) as error:
        raise argparse.ArgumentTypeError(f"{text!r}: {error}") from None
    return text


def add_calibration_objective(parser: argparse.ArgumentParser) -> None:
    """A calibration command's objective: --target-sparsity (a mean sparsity in (0, 1)) or --max-error (a bound
    >= 0 on each head's relative L1), exactly one, and --error (what a target sparsity's allocation minimises)."""
    from ..plan.calibration import ERRORS

    objective = parser.add_mutually_exclusive_group(required=True)
    objective.add_argument("--target-sparsity", type=lambda text: number_arg(
        text, float, lambda v: 0 < v < 1, "a mean sparsity in (0, 1)"), help="mean sparsity over layers and heads")
    objective.add_argument("--max-error", type=lambda text: number_arg(
        text, float, lambda v: v >= 0, "a relative L1 error >= 0"),
        help="bound on each head's attention-output relative L1")
    parser.add_argument("--error", choices=ERRORS, default=None,
                        help="--target-sparsity: the head errors whose sum is minimised: output (the default: through "
                             "its slice of the layer's output projection), relative (every head alike) or absolute "
                             "(weighed by the size of its output)")
    parser.add_argument("--noise-splits", type=noise_splits_arg, default=(), metavar="S1,S2,...",
                        help="measure and choose separately in ranges of the noise level split at these levels (in "
                             "(0, 1), ascending), e.g. 0.5 for one choice at high and one at low noise: a target "
                             "sparsity is then allocated over every range at once; the configuration switches with "
                             "each step's noise level (SparseConfig.noise_overrides)")
