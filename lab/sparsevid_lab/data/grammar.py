"""The caption grammar of the procedural videos: word lists, caption text and tokenisation.

A caption lists the objects of a clip in drawing order (later objects pass in front of earlier ones),
each as ``<size> <colour> <texture> <shape> <motion>``, joined by ``and``, followed by the background:

    "big red striped circle moving left and small cyan plain ring bouncing on a navy background"
"""
from __future__ import annotations

import torch

SIZES = ("small", "big")
COLOURS = ("red", "green", "blue", "yellow", "cyan", "magenta", "orange", "white")
TEXTURES = ("plain", "striped", "checkered")
SHAPES = ("circle", "square", "diamond", "ring")
MOTIONS = ("moving left", "moving right", "moving up", "moving down", "bouncing", "circling")
BACKGROUNDS = ("black", "gray", "navy", "beige")

PAD = "<pad>"
_CONNECTIVES = ("and", "on", "a", "background")


def _build_vocab() -> tuple[str, ...]:
    words: list[str] = [PAD]
    for group in (SIZES, COLOURS, TEXTURES, SHAPES, MOTIONS, BACKGROUNDS, _CONNECTIVES):
        for phrase in group:
            for word in phrase.split():
                if word not in words:
                    words.append(word)
    return tuple(words)


VOCAB = _build_vocab()
WORD_TO_ID = {word: i for i, word in enumerate(VOCAB)}
PAD_ID = WORD_TO_ID[PAD]


def max_caption_words(max_objects: int) -> int:
    """Longest caption (in words) for clips of up to ``max_objects`` objects."""
    if not isinstance(max_objects, int) or max_objects < 1:
        raise ValueError(f"max_objects must be a positive int, got {max_objects!r}")
    longest_motion = max(len(m.split()) for m in MOTIONS)
    return max_objects * (4 + longest_motion) + (max_objects - 1) + 4


def object_phrase(size: int, colour: int, texture: int, shape: int, motion: int) -> str:
    """``<size> <colour> <texture> <shape> <motion>`` from indices into the word lists."""
    return f"{SIZES[size]} {COLOURS[colour]} {TEXTURES[texture]} {SHAPES[shape]} {MOTIONS[motion]}"


def caption_text(objects: list[tuple[int, int, int, int, int]], background: int) -> str:
    """The caption of one clip: ``objects`` as (size, colour, texture, shape, motion) index tuples."""
    if not objects:
        raise ValueError("objects must list at least one object")
    return " and ".join(object_phrase(*o) for o in objects) + f" on a {BACKGROUNDS[background]} background"


def parse_caption(caption: str) -> tuple[list[tuple[int, int, int, int, int]], int]:
    """The inverse of :func:`caption_text`: (objects as (size, colour, texture, shape, motion) index
    tuples in drawing order, background index). Raises ValueError if ``caption`` is not a grammar caption."""
    if not isinstance(caption, str):
        raise TypeError(f"caption must be a str, got {type(caption).__name__}")
    words = caption.lower().split()
    if len(words) < 9 or words[-4:-1] != ["on", "a", words[-2]] or words[-1] != "background" \
            or words[-2] not in BACKGROUNDS:
        raise ValueError(f"caption {caption!r} does not end with 'on a <background> background' "
                         f"(backgrounds: {', '.join(BACKGROUNDS)})")
    objects = []
    for phrase in " ".join(words[:-4]).split(" and "):
        parts = phrase.split()
        if len(parts) < 5 or parts[0] not in SIZES or parts[1] not in COLOURS or parts[2] not in TEXTURES \
                or parts[3] not in SHAPES or " ".join(parts[4:]) not in MOTIONS:
            raise ValueError(f"caption {caption!r}: {phrase!r} is not '<size> <colour> <texture> <shape> "
                             f"<motion>' of the grammar")
        objects.append((SIZES.index(parts[0]), COLOURS.index(parts[1]), TEXTURES.index(parts[2]),
                        SHAPES.index(parts[3]), MOTIONS.index(" ".join(parts[4:]))))
    return objects, BACKGROUNDS.index(words[-2])


def tokenize(captions: list[str] | str, length: int) -> torch.Tensor:
    """Word ids of ``captions``, right-padded with PAD_ID: int64 [len(captions), length].

    The empty caption "" is the null caption used for classifier-free guidance (all PAD_ID).
    """
    if isinstance(captions, str):
        captions = [captions]
    if not isinstance(length, int) or length < 1:
        raise ValueError(f"length must be a positive int, got {length!r}")
    ids = torch.full((len(captions), length), PAD_ID, dtype=torch.long)
    for row, caption in enumerate(captions):
        if not isinstance(caption, str):
            raise TypeError(f"captions must be strings, got {type(caption).__name__}")
        words = caption.lower().split()
        if len(words) > length:
            raise ValueError(f"caption {caption!r} has {len(words)} words, more than length={length}")
        unknown = [w for w in words if w not in WORD_TO_ID or w == PAD]
        if unknown:
            raise ValueError(f"caption {caption!r} uses words outside the vocabulary: {unknown}")
        ids[row, : len(words)] = torch.tensor([WORD_TO_ID[w] for w in words], dtype=torch.long)
    return ids
