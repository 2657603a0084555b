"""Caption faithfulness of a set of clips, summarised: the mean overall score and the mean of every attribute.

The scores come from :func:`sparsevid.eval.faithfulness.faithfulness` (imported when first needed); where that
module is not installed, :func:`summarize_faithfulness` returns None and reports leave the column empty.
"""
from __future__ import annotations

import importlib.util
import numbers
from typing import Sequence

import torch

FAITHFULNESS_MODULE = "sparsevid.eval.faithfulness"


def faithfulness_available() -> bool:
    return importlib.util.find_spec(FAITHFULNESS_MODULE) is not None


def summarize_faithfulness(clips: torch.Tensor, captions: Sequence[str]) -> dict | None:
    """{"overall": mean over clips, "per_attribute": {name: mean over the clips scoring it}, "per_clip":
    [overall of each clip]} for clips float [n, 3, T, H, W] in [-1, 1] and their captions; None when the
    faithfulness module is not available."""
    if not faithfulness_available():
        return None
    from .faithfulness import faithfulness

    if clips.shape[0] != len(captions):
        raise ValueError(f"clips ({clips.shape[0]}) and captions ({len(captions)}) must have the same length")
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
