"""What the commands share about their arguments: parsing helpers that reject bad values with one clear
line, and :class:`CommandError` for a user error found later (a missing file, a caption the model cannot
draw), which ``sparsevid`` prints as ``error: ...`` and exits with status 2."""
from __future__ import annotations

import argparse

import torch


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


def _number(text: str, convert, valid, expected: str):
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
    return _number(text, float, lambda v: 0 < v <= 1, "a number in (0, 1]")


def positive_int_arg(text: str) -> int:
    return _number(text, int, lambda v: v >= 1, "a whole number >= 1")


def clip_arg(text: str) -> tuple[int, int, int]:
    """``"T,H,W"`` -> (frames, height, width), each a whole number >= 1 (``--clip``)."""
    try:
        shape = tuple(int(x) for x in text.split(","))
    except ValueError:
        shape = ()
    if len(shape) != 3 or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"expected three comma-separated whole numbers T,H,W, got {text!r}")
    return shape


def sparsity_arg(text: str) -> float:
    """A sparsity: the share of attention tiles skipped, a number in [0, 1)."""
    return _number(text, float, lambda v: 0 <= v < 1, "a sparsity in [0, 1)")


def slice_words_arg(field: str):
    """An argparse type for a slice option of the procedural data (``--backgrounds``, ``--colours``,
    ``--motions``): comma-separated words of that field of the caption grammar -> a list of them."""
    from ..data import SLICE_FIELDS

    vocabulary = SLICE_FIELDS[field]

    def parse(text: str) -> list[str]:
        words = [w.strip() for w in text.split(",") if w.strip()]
        unknown = [w for w in words if w not in vocabulary]
        if not words or unknown:
            raise argparse.ArgumentTypeError(f"expected comma-separated {field} out of {', '.join(vocabulary)}; "
                                             f"got {text!r}" + (f" (unknown: {', '.join(unknown)})" if unknown else ""))
        return words

    parse.__name__ = f"{field} list"
    return parse


def add_slice_arguments(parser, purpose: str) -> None:
    """``--max-objects``, ``--backgrounds``, ``--colours``, ``--motions``: a slice of the procedural scenes
    (``ProceduralVideos``); ``purpose`` completes each help text (e.g. "fine-tuning clips")."""
    parser.add_argument("--max-objects", type=positive_int_arg, default=None,
                        help=f"{purpose} with at most this many objects (without it: the model's limit)")
    for field, example in (("backgrounds", "navy"), ("colours", "red,blue"), ("motions", "moving left,moving right")):
        parser.add_argument(f"--{field}", type=slice_words_arg(field), default=None, metavar="WORDS",
                            help=f"{purpose} only with these {field}, comma-separated (e.g. '{example}'; "
                                 f"without it: all of them)")


def slice_options(args) -> dict:
    """The slice options given on the command line (see :func:`add_slice_arguments`) as ``ProceduralVideos``
    keyword arguments: {"max_objects": n, "backgrounds": [...], ...}, empty when none is given."""
    from ..data import SLICE_FIELDS

    names = ("max_objects", *SLICE_FIELDS)
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}


def positive_float_arg(text: str) -> float:
    return _number(text, float, lambda v: v > 0, "a number > 0")


def check_caption_words(caption: str) -> None:
    """CommandError unless every word of ``caption`` is in the built-in caption grammar; the message lists
    the allowed words."""
    from ..data import grammar

    unknown = [w for w in caption.lower().split() if w not in grammar.WORD_TO_ID or w == grammar.PAD]
    if not unknown:
        return
    groups = {"sizes": grammar.SIZES, "colours": grammar.COLOURS, "textures": grammar.TEXTURES,
              "shapes": grammar.SHAPES, "motions": grammar.MOTIONS, "backgrounds": grammar.BACKGROUNDS}
    allowed = "; ".join(f"{name}: {', '.join(words)}" for name, words in groups.items())
    raise CommandError(f"the caption uses words the built-in model does not know: {', '.join(unknown)}. "
                       f"A caption reads '<size> <colour> <texture> <shape> <motion> [and <object>...] on a "
                       f"<background> background'; {allowed}")


def check_caption_fits(model, caption: str) -> None:
    """CommandError unless ``model`` (a BuiltinVideoDiT) can draw ``caption``: few enough objects and words."""
    if not model.data.fits(caption):
        raise CommandError(f"the caption has more objects or words than this model was trained on (at most "
                           f"{model.data.max_objects} objects, {model.data.caption_length} words): {caption!r}")


def model_dir_arg(text: str) -> str:
    """``--model``: a directory holding a built-in model (its weights and config)."""
    from pathlib import Path

    from ..models.builtin import CONFIG_FILE, WEIGHTS_FILE

    missing = [name for name in (WEIGHTS_FILE, CONFIG_FILE) if not (Path(text) / name).is_file()]
    if missing:
        raise argparse.ArgumentTypeError(f"{text!r} is not a model directory: {' and '.join(missing)} not found "
                                         f"(`sparsevid train` and `sparsevid distill` write them)")
    return text


def student_dir_arg(text: str) -> str:
    """``--student``: a sparse student's directory, either a shipped asset (student.json and
    student.safetensors, as `sparsevid export-student` writes) or a `sparsevid distill` output directory (a
    model directory with its sparse_config.json)."""
    from pathlib import Path

    from ..models.sparse_student import STUDENT_CONFIG
    from ..training.distill import SPARSE_CONFIG_FILE
    from .students import is_student_asset

    if is_student_asset(text):
        return text
    model_dir_arg(text)
    if not (Path(text) / SPARSE_CONFIG_FILE).is_file():
        raise argparse.ArgumentTypeError(f"neither {STUDENT_CONFIG} (a student asset) nor {SPARSE_CONFIG_FILE} (a "
                                         f"`sparsevid distill` output directory) found in {text!r}")
    return text


def config_spec_arg(text: str) -> str:
    """``--config``-like options: a SparseConfig as 'key=value,...' or a JSON file, checked here."""
    from ..eval.harness import parse_config

    try:
        parse_config(text)
    except (ValueError, TypeError, OSError) as error:
        raise argparse.ArgumentTypeError(f"{text!r}: {error}") from None
    return text
