"""Training-free quality of the built-in model under top-k / top-p / hybrid at fixed sparsities.

1. One dense generation records the video self-attention q, k, v of every layer at the probe steps
   (3D-tiled token order, as the sparse processors see them).
2. From those: how much exact attention mass the top 5% of tiles hold, per layer (dense model).
3. Calibration on the recorded q, k: for each target sparsity s, top-k keeps the fraction 1 - s; top-p's p is
   found by bisection so the mean predicted sparsity is s; hybrid keeps top-k (1 - s) / 2 united with a
   top-p whose p is found the same way.
4. The quality harness (``sparsevid_lab.eval.harness.run_harness``) samples every configuration and reports
   achieved sparsity, PSNR / SSIM against the dense clips, recall and relative L1 per layer.

    python3 -m sparsevid_lab.studies.builtin_quality --out lab/results/builtin_quality_cpu
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

import sparsevid as sv
from benchmarks.run_info import run_metadata
from ..eval.harness import DEFAULT_CAPTIONS, markdown_table, run_harness
from ..model.builtin import load_builtin
from sparsevid.integration.processors import SDPAInterceptor

BLOCKS = dict(block_q=128, block_k=64)


class Recorder:
    """SDPA handler that keeps q, k, v [B, H, N, D] of video self-attention calls (tiled order) at given steps."""

    def __init__(self, grid, steps):
        self.grid, self.steps, self.step, self.layer = grid, set(steps), 0, 0
        self.calls: list[tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.perm, _ = sv.tile_permutation(grid)

    def on_step(self, i: int, t: float) -> None:
        self.step, self.layer = i, 0

    def __call__(self, query, key, value, **kwargs):
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, **kwargs)
        if self.step in self.steps and query.shape[2] == key.shape[2] == math.prod(self.grid):
            q, k, v = (t.index_select(2, self.perm.to(t.device)) for t in (query, key, value))
            self.calls.append((self.step, self.layer, q, k, v))
            self.layer += 1
        return out


def top_tile_mass(q, k, v, fraction: float) -> float:
    """Mean over rows of the exact attention mass held by the top ``fraction`` of key blocks of each row."""
    full = sv.SparseMask.full(q.shape[2], k.shape[2], device=q.device, **BLOCKS)
    _, mass = sv.block_sparse_attention(q, k, v, full, return_tile_mass=True, backend="reference")
    top = max(1, math.ceil(fraction * mass.shape[-1]))
    return float(mass.topk(top, dim=-1).values.sum(-1).mean())


def mean_sparsity(calls, **rule) -> float:
    return sum(sv.predict_mask(q, k, **BLOCKS, **rule)[0].sparsity for _, _, q, k, _ in calls) / len(calls)


def calibrate_topp(calls, target: float, topk: float | None) -> float:
    """p in (0, 1] whose mean predicted sparsity over ``calls`` is closest to ``target`` (bisection)."""
    rule = dict(rule="topp") if topk is None else dict(rule="hybrid", topk=topk)
    low, high = 1e-4, 1.0
    for _ in range(14):
        mid = (low + high) / 2
        if mean_sparsity(calls, topp=mid, **rule) > target:
            low = mid  # too sparse: keep more mass
        else:
            high = mid
    return (low + high) / 2


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--targets", default="0.9,0.95,0.97")
    parser.add_argument("--captions", type=int, default=2)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model = load_builtin(device=args.device)
    steps = model.config["sampling"]["steps"]
    probe_steps = sorted({0, steps // 2, steps - 1})
    p_t, p_h, p_w = model.transformer.config.patch_size
    _, frames, height, width = model.clip_shape
    grid = (frames // p_t, height // p_h, width // p_w)

    recorder = Recorder(grid, probe_steps)
    from ..model.sampling import generate

    with SDPAInterceptor(recorder):
        generate(model, [DEFAULT_CAPTIONS[0]], [args.seeds[0]], on_step=recorder.on_step)
    layers = sorted({layer for _, layer, *_ in recorder.calls})
    top5 = {layer: sum(top_tile_mass(q, k, v, 0.05) for _, l_, q, k, v in recorder.calls if l_ == layer)
            / sum(1 for _, l_, *_ in recorder.calls if l_ == layer) for layer in layers}
    print("exact attention mass held by the top 5% of tiles, per layer:",
          {layer: round(m, 3) for layer, m in top5.items()}, flush=True)

    configs, calibration = {}, {}
    for target in (float(t) for t in args.targets.split(",")):
        keep = round(1.0 - target, 4)
        topp = calibrate_topp(recorder.calls, target, None)
        hybrid_topp = calibrate_topp(recorder.calls, target, keep / 2)
        calibration[str(target)] = {"topk": keep, "topp": topp, "hybrid_topk": keep / 2, "hybrid_topp": hybrid_topp}
        print(f"target {target}: topk {keep}, topp {topp:.4f}, hybrid topk {keep / 2} + topp {hybrid_topp:.4f}",
              flush=True)
        configs[f"topk {target:.0%}"] = sv.SparseConfig(rule="topk", topk=keep, **BLOCKS)
        configs[f"topp {target:.0%}"] = sv.SparseConfig(rule="topp", topp=topp, **BLOCKS)
        configs[f"hybrid {target:.0%}"] = sv.SparseConfig(rule="hybrid", topk=keep / 2, topp=hybrid_topp, **BLOCKS)

    results = run_harness(model, configs, captions=DEFAULT_CAPTIONS[:args.captions], seeds=args.seeds,
                          steps=steps, probe_steps=probe_steps)
    results.pop("clips")
    results.update({**run_metadata(args.device), "top5_tile_mass_per_layer": top5, "calibration": calibration})
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    table = markdown_table(results)
    top5_row = " | ".join(f"{top5[layer]:.3f}" for layer in layers)
    (args.out / "results.md").write_text(
        f"{table}\n\nExact attention mass held by the top 5% of tiles (dense model, tiled order), layers "
        f"{layers[0]}..{layers[-1]}: {top5_row}\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
