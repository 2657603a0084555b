"""Caption faithfulness of a set of clips, summarised: the mean overall score and the mean of every attribute
(:func:`sparsevid_lab.eval.faithfulness.faithfulness` scores each clip)."""
from __future__ import annotations

import numbers
from typing import Sequence

import torch


def summarize_faithfulness(clips: torch.Tensor, captions: Sequence[str]) -> dict:
    """{"overall": mean over clips, "per_attribute": {name: mean over the clips that score it}, "per_clip":
    [overall of each clip]} for clips float [n, 3, T, H, W] in [-1, 1] and their captions. Attributes are the
    clip-level scores (background, count, colour, size, motion, and texture where it can be read: a None
    score is left out of its mean)."""
    from .faithfulness import faithfulness

    scores = faithfulness(clips, list(captions))
    per_attribute: dict[str, list[float]] = {}
    for score in scores:
        for name, value in score.items():
            if name != "overall" and isinstance(value, numbers.Real) and not isinstance(value, bool):
                per_attribute.setdefault(name, []).append(float(value))
    overall = [float(score["overall"]) for score in scores]
    return {"overall": sum(overall) / len(overall),
            "per_attribute": {name: sum(v) / len(v) for name, v in sorted(per_attribute.items())},
            "per_clip": overall}
