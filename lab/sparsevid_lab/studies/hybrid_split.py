"""Claim 2 on the built-in model: at one sparsity, how much exact attention mass does a mask keep as its budget
moves from top-k to top-p?

The hybrid rule keeps the union of a top-k and a top-p mask. At a target sparsity s the kept fraction 1 - s can
go all to top-k (share 1: the top-k rule), all to top-p (share 0: the top-p rule) or be split: top-k keeps
``share * (1 - s)`` of each row's key blocks and top-p's threshold is calibrated (bisection, as the claims grid
does) so that the union has mean sparsity s over the recorded calls. The claims grid's hybrid is share 0.5.
For every share this reports the exact attention mass the predicted masks keep (recall), the mass of the
heaviest tiles at the same per-row counts (the ceiling) and the achieved sparsity, over the video
self-attention calls of one dense generation (first, middle and last step, every layer).

    python3 -m sparsevid_lab.studies.hybrid_split --out OUT [--model DIR] [--target 0.95] [--steps 10]

On the CPU at the long clip a generation takes minutes per step: ``--steps 4`` keeps it under half an hour.
Writes OUT/hybrid_split.json and OUT/hybrid_split.md.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from benchmarks.run_info import run_metadata
from sparsevid.eval import calibrate_topp

from ..eval.recording import record_video_attention
from ..eval.harness import DEFAULT_CAPTIONS
from sparsevid.eval.oracle import ExactTiles, predicted_recall
from ..model.builtin import load_builtin
from sparsevid.ops import predict_mask

SHARES = (0.0, 0.25, 0.5, 0.75, 0.9, 1.0)
BLOCKS = dict(block_q=128, block_k=64)


def rule_for_share(share: float, target: float, calls) -> dict:
    """The predict_mask rule that gives ``share`` of the kept fraction 1 - target to top-k (module docstring)."""
    keep = 1.0 - target
    if share >= 1.0:
        return dict(rule="topk", topk=round(keep, 4))
    if share <= 0.0:
        return dict(rule="topp", topp=round(calibrate_topp(calls, target, **BLOCKS), 5))
    topk = round(share * keep, 5)
    return dict(rule="hybrid", topk=topk, topp=round(calibrate_topp(calls, target, topk, **BLOCKS), 5))


def split_study(calls, target: float, shares=SHARES) -> list[dict]:
    """One row per share: the rule, mean achieved sparsity, mean recall and mean ceiling over ``calls``
    ([(q, k)] in 3D-tile order, as :func:`record_video_attention` returns them)."""
    tiles = [ExactTiles.measure(q, k, torch.zeros_like(k), **BLOCKS) for q, k in calls]  # v plays no part in masses
    rows = []
    for share in shares:
        rule = rule_for_share(share, target, calls)
        found = [predicted_recall(t, predict_mask(q, k, **rule, **BLOCKS)[0]) for t, (q, k) in zip(tiles, calls)]
        rows.append({"share": share, **rule, **{key: sum(f[key] for f in found) / len(found)
                                               for key in ("sparsity", "recall", "oracle_recall")}})
        print(table(rows[-1:]), flush=True)
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| top-k share | rule | top-k | top-p | sparsity | recall | ceiling at the same counts |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['share']:.2f} | {r['rule']} | {r.get('topk', '-')} | {r.get('topp', '-')} | "
                     f"{r['sparsity']:.3f} | {r['recall']:.3f} | {r['oracle_recall']:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", type=Path, default=None, help="model directory (default: the shipped model)")
    parser.add_argument("--target", type=float, default=0.95, help="sparsity every share is calibrated to")
    parser.add_argument("--shares", type=float, nargs="+", default=list(SHARES),
                        help="shares of the kept fraction given to top-k (0: top-p alone, 1: top-k alone)")
    parser.add_argument("--steps", type=int, default=None, help="sampler steps (default: the model's)")
    parser.add_argument("--caption", default=DEFAULT_CAPTIONS[0])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if not 0 < args.target < 1:
        parser.error(f"--target must be a sparsity in (0, 1), got {args.target}")
    if not all(0 <= s <= 1 for s in args.shares):
        parser.error(f"--shares must lie in [0, 1], got {args.shares}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = load_builtin(args.model, device=device, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
    calls = record_video_attention(model, args.caption, args.seed, args.steps)
    rows = split_study(calls, args.target, args.shares)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = run_metadata(model=str(args.model or "shipped"), clip=list(model.clip_shape[1:]), target=args.target,
                        caption=args.caption, seed=args.seed, steps=args.steps or model.config["sampling"]["steps"],
                        calls=len(calls))
    (args.out / "hybrid_split.json").write_text(json.dumps({**meta, "rows": rows}, indent=1))
    (args.out / "hybrid_split.md").write_text(table(rows))
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
