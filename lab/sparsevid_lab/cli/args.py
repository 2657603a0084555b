"""What the commands share about their arguments: parsing helpers that reject bad values with one clear
line, and :class:`CommandError` for a user error found later (a missing file, a caption the model cannot
draw), which ``sparsevid`` prints as ``error: ...`` and exits with status 2."""
from __future__ import annotations

import argparse

from sparsevid.cli.args import CommandError, positive_int_arg


def clip_arg(text: str) -> tuple[int, int, int]:
    """``"T,H,W"`` -> (frames, height, width), each a whole number >= 1 (``--clip``)."""
    try:
        shape = tuple(int(x) for x in text.split(","))
    except ValueError:
        shape = ()
    if len(shape) != 3 or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"expected three comma-separated whole numbers T,H,W, got {text!r}")
    return shape


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

    from ..model.builtin import CONFIG_FILE, WEIGHTS_FILE

    missing = [name for name in (WEIGHTS_FILE, CONFIG_FILE) if not (Path(text) / name).is_file()]
    if missing:
        raise argparse.ArgumentTypeError(f"{text!r} is not a model directory: {' and '.join(missing)} not found "
                                         f"(`python -m sparsevid_lab train` writes them)")
    return text


def student_dir_arg(text: str) -> str:
    """``--student``: a sparse student's folder (student.json and student.safetensors, as `distill` writes)."""
    from .students import is_student

    if not is_student(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a student folder: student.json and student.safetensors "
                                         f"not found (`python -m sparsevid_lab distill` writes them)")
    return text


def add_study_model_options(parser: argparse.ArgumentParser) -> None:
    """A study's model, clip, tiles and device: --block-q, --block-k, --clip, --model, --tiny, --device (for
    ``cli.demo.load_model``)."""
    import torch

    parser.add_argument("--block-q", type=int, default=128)
    parser.add_argument("--block-k", type=int, default=64)
    parser.add_argument("--clip", type=clip_arg, default=None, metavar="T,H,W",
                        help="clip shape (default: the model's own, 32,128,128 on a GPU)")
    parser.add_argument("--model", default=None, help="model directory (default: the shipped model)")
    parser.add_argument("--tiny", action="store_true", help="an untrained tiny model (check on the CPU)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")


def parse_study_args(parser: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    """``parser``'s arguments, its ``--sparsities`` checked to lie in (0, 1)."""
    args = parser.parse_args(argv)
    if not all(0 < s < 1 for s in args.sparsities):
        parser.error(f"--sparsities must lie in (0, 1), got {args.sparsities}")
    return args
