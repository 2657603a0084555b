"""Why does the built-in model not show the captioned motion? Sampler settings and equal-budget training levers,
measured by the dense caption faithfulness of sampled clips (above all its motion score).

Two parts, each on one GPU:

* ``sampler``: the trained model as it is, sampled with other settings (steps, guidance, time shift,
  scheduler); no training. If motion appears with more steps or another shift, the sampler was the limit.
* ``train``: warm restarts of the model, one per lever, each trained for the same wall-clock budget on short
  clips (dense, rectified flow), then sampled with the model's own sampler: ``baseline`` (the pre-training
  settings), ``high_noise`` (noise levels drawn with time shift 5 instead of 2: more training where the layout
  and the trajectories are decided), ``plain`` (backgrounds without texture or pan: is the texture in the way?).

    python3 -m benchmarks.motion_study --out OUT --part sampler [--model DIR]
    python3 -m benchmarks.motion_study --out OUT --part train --seconds 100 [--model DIR]

Writes OUT/motion_<part>.json and OUT/motion_<part>.md (one row per setting: faithfulness overall and per
attribute over the evaluation captions x seeds, short clips 16 x 64 x 64).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from benchmarks.builtin_study import SHORT, train_phase
from benchmarks.run_info import run_metadata
from sparsevid.eval.faithfulness_summary import summarize_faithfulness
from sparsevid.eval.harness import DEFAULT_CAPTIONS
from sparsevid.models import load_builtin
from sparsevid.models.sampling import generate

SEEDS = (0, 1)
# (label, sampler overrides); the first is the model's own setting (10 UniPC steps, guidance 4, shift 5).
SAMPLERS = (
    ("own", {}),
    ("steps 30", {"steps": 30}),
    ("steps 50", {"steps": 50}),
    ("guidance 2", {"guidance": 2.0}),
    ("guidance 7", {"guidance": 7.0}),
    ("shift 3", {"shift": 3.0}),
    ("shift 8", {"shift": 8.0}),
    ("euler 30", {"scheduler": "euler", "steps": 30}),
)
# (label, data overrides, time shift of the training noise levels)
LEVERS = (
    ("baseline", {}, 2.0),
    ("high_noise", {}, 5.0),
    ("plain", {"background_texture": 0.0, "pan": 0.0}, 2.0),
)
ATTRIBUTES = ("background", "colour", "count", "size", "motion", "texture")


def evaluate(model, **sampler) -> dict:
    """Dense faithfulness of the evaluation captions x seeds sampled with ``sampler`` overrides."""
    captions = [c for c in DEFAULT_CAPTIONS if model.data.fits(c)]
    pairs = [(c, s) for s in SEEDS for c in captions]
    start = time.perf_counter()
    clips = generate(model, [c for c, _ in pairs], [s for _, s in pairs], **sampler)
    seconds = time.perf_counter() - start
    summary = summarize_faithfulness(clips, [c for c, _ in pairs])
    return {"clips": len(pairs), "sampling_seconds": round(seconds, 1), "overall": summary["overall"],
            "per_attribute": summary["per_attribute"]}


def table(rows: dict) -> str:
    head = "| setting | overall | " + " | ".join(ATTRIBUTES) + " | training |\n|---|---|" + "---|" * len(ATTRIBUTES) + "---|\n"
    lines = []
    for label, row in rows.items():
        attrs = " | ".join(f"{row['per_attribute'].get(a, float('nan')):.3f}" for a in ATTRIBUTES)
        training = row.get("training")
        trained = f"{training['steps']} steps, loss {training['final_loss']:.4f}" if training else "-"
        lines.append(f"| {label} | {row['overall']:.3f} | {attrs} | {trained} |")
    return head + "\n".join(lines) + "\n"


def run_part(args) -> dict:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    rows = {}
    if args.part == "sampler":
        model = load_builtin(args.model, device=device, dtype=dtype)
        model.use_clip(*SHORT)
        for label, overrides in SAMPLERS[: args.limit]:
            rows[label] = dict(evaluate(model, **overrides), sampler=overrides)
            print(table({label: rows[label]}), flush=True)
        return rows
    for label, data, shift in LEVERS[: args.limit]:
        model = load_builtin(args.model, device=device)  # trained in fp32 (bf16 autocast on CUDA), sampled in bf16
        model.config["data"].update(data)
        model.use_clip(*SHORT)
        model.train()
        training = train_phase(model, SHORT, args.batch_size, args.seconds, seed=0, lr=args.lr, shift=shift,
                               max_steps=args.max_steps)
        model.eval().to(dtype)
        rows[label] = dict(evaluate(model, steps=args.sample_steps), training=training, data=data, train_shift=shift)
        print(table({label: rows[label]}), flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--part", choices=("sampler", "train"), required=True)
    parser.add_argument("--model", type=Path, default=None, help="model directory (default: the shipped model)")
    parser.add_argument("--seconds", type=float, default=100.0, help="training budget of each lever (part train)")
    parser.add_argument("--max-steps", type=int, default=None, help="step cap of each lever (a CPU smoke run)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--sample-steps", type=int, default=None, help="sampler steps after training (default: the model's)")
    parser.add_argument("--limit", type=int, default=None, help="only the first N settings (a CPU smoke run)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = run_part(args)
    meta = run_metadata(model=str(args.model or "shipped"), clip=list(SHORT), seeds=list(SEEDS), part=args.part,
                        seconds=args.seconds if args.part == "train" else None)
    (args.out / f"motion_{args.part}.json").write_text(json.dumps({**meta, "settings": rows}, indent=1))
    (args.out / f"motion_{args.part}.md").write_text(table(rows))
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
