"""Validate ``sparsevid_lab.eval.faithfulness`` on ground-truth procedural clips.

For each setting (resolution, plain or textured panning background) it renders clips from
``ProceduralVideos`` and scores them against their own captions (true), against the caption of the next
clip of the batch (shuffled), and against their caption with one attribute swapped (background, one
object's colour, size or motion, each to another value of its word list). It prints a markdown table
and writes it with the raw means to ``--out`` (JSON + markdown).

    python -m sparsevid_lab.studies.faithfulness_validation --clips 64 --seed 1000 --out lab/results/faithfulness
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from benchmarks.run_info import run_metadata
from ..data import ProceduralVideos, grammar
from ..eval.faithfulness import faithfulness, swap_attribute

SETTINGS = {  # name: ProceduralVideos arguments
    "16x64x64": dict(frames=16, height=64, width=64),
    "16x64x64 textured": dict(frames=16, height=64, width=64, background_texture=0.4, pan=0.3),
    "32x128x128": dict(frames=32, height=128, width=128),
    "32x128x128 textured": dict(frames=32, height=128, width=128, background_texture=0.4, pan=0.3),
    "16x64x64 strong texture": dict(frames=16, height=64, width=64, background_texture=0.7, pan=0.5),
    "32x128x128 strong texture": dict(frames=32, height=128, width=128, background_texture=0.7, pan=0.5),
}
SCORES = ("overall", "background", "count", "colour", "size", "motion", "texture")
SWAPS = ("background", "colour", "size", "motion", "texture")
BATCH = 8


def _swapped(caption: str, attribute: str, clip: int) -> tuple[str, int]:
    """``caption`` with ``attribute`` swapped (deterministically varied over ``clip``), and the index of
    the object swapped (0 for the background)."""
    objects, _ = grammar.parse_caption(caption)
    index = 0 if attribute == "background" else clip % len(objects)
    size = {"background": len(grammar.BACKGROUNDS), "colour": len(grammar.COLOURS), "size": len(grammar.SIZES),
            "motion": len(grammar.MOTIONS), "texture": len(grammar.TEXTURES)}[attribute]
    return swap_attribute(caption, attribute, shift=1 + clip % (size - 1), index=index), index


def _attribute(score: dict, attribute: str, index: int) -> float | None:
    """The score of ``attribute`` (of object ``index`` for object attributes) in one clip's ``score``
    (None: a texture that cannot be read)."""
    return score["background"] if attribute == "background" else score["objects"][index][attribute]


def validate(setting: dict, clips: int, seed: int) -> dict:
    """Mean scores over ``clips`` clips of ``setting`` (batches seeded ``seed``, ``seed`` + 1, ...)."""
    data = ProceduralVideos(**setting)
    true, shuffled, seconds = [], [], []
    swapped = {name: {"overall": [], "attribute": [], "attribute_true": []} for name in SWAPS}
    for batch in range(0, clips, BATCH):
        video, captions = data.sample(min(BATCH, clips - batch), torch.Generator().manual_seed(seed + batch // BATCH))
        start = time.perf_counter()
        scores = faithfulness(video, captions)
        seconds.append(time.perf_counter() - start)
        true += scores
        shuffled += faithfulness(video, captions[1:] + captions[:1]) if len(captions) > 1 else []
        for name in SWAPS:
            pairs = [_swapped(caption, name, batch + i) for i, caption in enumerate(captions)]
            for (_, obj), score, truth in zip(pairs, faithfulness(video, [p[0] for p in pairs]), scores):
                if _attribute(score, name, obj) is None or _attribute(truth, name, obj) is None:
                    continue  # a texture that cannot be read
                swapped[name]["overall"].append(score["overall"])
                swapped[name]["attribute"].append(_attribute(score, name, obj))
                swapped[name]["attribute_true"].append(_attribute(truth, name, obj))
    def mean(values):
        values = [v for v in values if v is not None]  # clips with no readable texture
        return statistics.mean(values)

    return {
        "clips": clips,
        "seconds_per_batch_of_8": mean(seconds),
        "true": {k: mean(s[k] for s in true) for k in SCORES},
        "true_min_overall": min(s["overall"] for s in true),
        "texture_unreadable": statistics.mean(o["texture"] is None for s in true for o in s["objects"]),
        "shuffled": {k: mean(s[k] for s in shuffled) for k in SCORES},
        "swapped": {name: {k: mean(v) for k, v in values.items()} for name, values in swapped.items()},
    }


def markdown(results: dict) -> str:
    lines = ["| setting | pairs | " + " | ".join(SCORES) + " |", "|---|---|" + "---|" * len(SCORES)]
    for name, result in results.items():
        for kind in ("true", "shuffled"):
            lines.append(f"| {name} | {kind} | " + " | ".join(f"{result[kind][k]:.3f}" for k in SCORES) + " |")
    lines += ["", "| setting | swapped | overall | that attribute (true caption) | that attribute (swapped) |",
              "|---|---|---|---|---|"]
    for name, result in results.items():
        for swap, values in result["swapped"].items():
            lines.append(f"| {name} | {swap} | {values['overall']:.3f} | {values['attribute_true']:.3f} | "
                         f"{values['attribute']:.3f} |")
    lines += ["", "| setting | lowest overall, true pairs | objects with unreadable texture | seconds per batch of 8 |",
              "|---|---|---|---|"]
    for name, result in results.items():
        lines.append(f"| {name} | {result['true_min_overall']:.3f} | {result['texture_unreadable']:.3f} | "
                     f"{result['seconds_per_batch_of_8']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clips", type=int, default=64, help="clips per setting")
    parser.add_argument("--seed", type=int, default=1000, help="seed of the first batch of 8 clips")
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--out", type=Path, default=None, help="folder for results.json and results.md")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = {name: validate(SETTINGS[name], args.clips, args.seed) for name in args.settings}
    table = markdown(results)
    print(table)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        meta = run_metadata("cpu", clips=args.clips, seed=args.seed)
        (args.out / "results.json").write_text(json.dumps({**meta, "results": results}, indent=2))
        (args.out / "results.md").write_text(f"`python -m sparsevid_lab.studies.faithfulness_validation "
                                             f"--clips {args.clips} --seed {args.seed}`\n\n{table}\n")


if __name__ == "__main__":
    main()
