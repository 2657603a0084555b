"""Which levers make the built-in model's attention concentrate? Equal-budget training runs, measured by
oracle recall.

Each variant trains a built-in video DiT from scratch with the rectified-flow objective for the same
wall-clock budget on one GPU, then records the video self-attention q, k, v of every layer on held-out
clips at several noise levels (direct forwards of noised clips, 3D-tiled token order as the sparse
processors see them) and measures, per layer and noise level:

* oracle recall: the exact attention mass held by the top (1 - s) of the tiles of each query block, at
  sparsity s (exact tile masses from ``block_sparse_attention(..., return_tile_mass=True)``; the count of
  kept tiles is interpolated between whole tiles so every model is read at exactly s);
* oracle output error: relative L1 of the attention output with only those top tiles kept (whole tiles,
  the nearest count), against dense attention.

    python3 -m sparsevid_lab.studies.builtin_study --out OUT [--seconds 75] [--variants plain,textured,...]
    python3 -m sparsevid_lab.studies.builtin_study --out OUT --model DIR     # measure a trained model only

Writes OUT/study.json (everything) and OUT/study.md (one row per variant) after every variant.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import time
from pathlib import Path

import torch

from benchmarks.run_info import run_metadata
from ..data import ProceduralVideos
from sparsevid.eval.oracle import ExactTiles
from ..model.builtin import DEFAULT_CONFIG, BuiltinVideoDiT, pretraining_loss
from sparsevid.integration.processors import SDPAInterceptor
from sparsevid.integration.token_order import tile_order
from sparsevid.training import LoopConfig, sample_t, train_loop
from sparsevid.training.flow import noisy

BLOCKS = dict(block_q=128, block_k=64)
SPARSITIES = (0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95, 0.97)
WAN_RECALL = 0.85  # oracle recall at 95% sparsity that counts as Wan-like (see docs/builtin_model.md)
ERROR_SPARSITIES = (0.9, 0.95, 0.97)
NOISE_LEVELS = (0.95, 0.85, 0.7, 0.5, 0.25)
SHORT, LONG = (16, 64, 64), (32, 128, 128)
TEXTURE = dict(background_texture=0.4, pan=0.3)

# name: (data options, transformer overrides, training phases [(clip shape, batch, share of the budget)]).
# The model is measured after every phase (on short clips, and on long clips once it has trained on them),
# so a chain of phases also gives the training-time and length levers.
VARIANTS = {
    "plain": ({}, {}, [(SHORT, 64, 1.0)]),
    "textured_strong": (dict(background_texture=0.7, pan=0.5), {}, [(SHORT, 64, 1.0)]),
    "textured_4heads": (TEXTURE, {"num_attention_heads": 4}, [(SHORT, 64, 1.0)]),
    "textured": (TEXTURE, {}, [(SHORT, 64, 1.0), (SHORT, 64, 1.0), (LONG, 4, 0.8)]),
}


def model_config(data: dict, transformer: dict, clip: tuple[int, int, int]) -> dict:
    config = copy.deepcopy(DEFAULT_CONFIG)
    config["transformer"].update(transformer)
    config["data"].update(dict(zip(("frames", "height", "width"), clip)), **data)
    return config


def train_phase(model, clip, batch: int, seconds: float, seed: int, lr: float, shift: float = 2.0,
                max_steps: int | None = None, object_weight: float = 1.0, data_options: dict | None = None) -> dict:
    """Dense rectified-flow training on clips of shape ``clip`` for ``seconds`` (and at most ``max_steps``), noise
    levels drawn with time ``shift``, the objects' pixels weighing ``object_weight`` times the background's in
    the loss, the clips drawn with the model's data options updated by ``data_options`` (e.g. ``{"max_objects": 1}``;
    the captions keep the model's word count); returns the loss summary."""
    if not object_weight > 0:
        raise ValueError(f"object_weight must be positive, got {object_weight!r}")
    model.use_clip(*clip)
    data = ProceduralVideos(**{**model.data.config(), **(data_options or {})})
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    noise_gen = torch.Generator(device=device).manual_seed(seed + 1)
    null = model.tokenize([""])

    def loss_fn(step: int) -> torch.Tensor:
        scenes = data.sample_scenes(batch, gen)  # the draws of data.sample(batch, gen, device)
        video, captions = data.render(scenes, device), scenes.captions()
        weight = None if object_weight == 1.0 else 1 + (object_weight - 1) * data.object_mask(scenes, video).float()
        tokens = model.tokenize(captions)
        drop = torch.rand(batch, generator=gen) < 0.1
        tokens = torch.where(drop.unsqueeze(1), null, tokens).to(device)
        t = sample_t(batch, gen, device, shift=shift)
        noise = torch.randn(video.shape, generator=noise_gen, device=device)
        return pretraining_loss(model, video, tokens, t, noise, weight=weight)

    config = LoopConfig(lr=lr, warmup_steps=100, ema_decay=None, max_seconds=seconds, max_steps=max_steps,
                        log_every=100)
    result = train_loop(model, loss_fn, config, log=lambda line: print("   ", line, flush=True))
    return {"clip": list(clip), "batch": batch, "steps": result.steps, "seconds": round(result.seconds, 1),
            "final_loss": result.history[-1]["loss"]}


class QKVRecorder:
    """SDPA handler that keeps q, k, v [B, H, N, D] of the video self-attention calls, in 3D-tiled order (as the
    sparse processors see them) or, with ``tiled=False``, in the model's raster order (frame by frame)."""

    def __init__(self, grid: tuple[int, int, int], device, tiled: bool = True):
        self.tokens = math.prod(grid)
        self.order = tile_order(grid, "auto", device) if tiled else None
        self.calls: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def __call__(self, query, key, value, **kwargs):
        if query.shape[2] == key.shape[2] == self.tokens:
            qkv = (query, key, value)
            self.calls.append(qkv if self.order is None else tuple(t.index_select(2, self.order.perm) for t in qkv))
        return torch.nn.functional.scaled_dot_product_attention(query, key, value, **kwargs)


def recall_at(sorted_cumsum: torch.Tensor, sparsity: float) -> float:
    """Mean exact mass of the top (1 - sparsity) tiles per query block, interpolating between whole tiles (so
    models with different key-block counts are read at exactly ``sparsity``).

    sorted_cumsum: float32 [..., KB], the cumulative sum of each query block's tile masses sorted descending.
    """
    blocks = sorted_cumsum.shape[-1]
    count = (1.0 - sparsity) * blocks
    whole = int(math.floor(count))
    padded = torch.cat([torch.zeros_like(sorted_cumsum[..., :1]), sorted_cumsum], -1)
    low, high = padded[..., whole], padded[..., min(whole + 1, blocks)]
    return float((low + (count - whole) * (high - low)).mean())


def sparsity_at_recall(sorted_cumsum: torch.Tensor, target: float = WAN_RECALL) -> float:
    """The sparsity at which the mean oracle recall equals ``target`` (bisection on :func:`recall_at`)."""
    low, high = 0.0, 1.0 - 1.0 / sorted_cumsum.shape[-1]
    for _ in range(30):
        mid = (low + high) / 2
        low, high = (mid, high) if recall_at(sorted_cumsum, mid) >= target else (low, mid)
    return low


def oracle_metrics(q, k, v) -> dict:
    """Oracle recall at SPARSITIES, the sparsity of recall WAN_RECALL, and the oracle output error at
    ERROR_SPARSITIES (the nearest whole count of tiles per row) for one attention call."""
    tiles = ExactTiles.measure(q, k, v, **BLOCKS)
    cumsum = tiles.mass.float().sort(dim=-1, descending=True).values.cumsum(-1)
    blocks = tiles.mass.shape[-1]
    return {"recall": {str(s): recall_at(cumsum, s) for s in SPARSITIES},
            "sparsity_at_recall": sparsity_at_recall(cumsum),
            "output_error": {str(s): tiles.output_error(q, k, v, tiles.top_tiles(max(1, round((1 - s) * blocks))))
                             for s in ERROR_SPARSITIES}}


def token_grid(model: BuiltinVideoDiT) -> tuple[int, int, int]:
    """(frames, height, width) in tokens of the model's current clip shape."""
    _, frames, height, width = model.clip_shape
    p_t, p_h, p_w = model.config["transformer"]["patch_size"]
    return frames // p_t, height // p_h, width // p_w


@torch.no_grad()
def recorded_attention(model: BuiltinVideoDiT, clips: int, seed: int, levels, tiled: bool = True):
    """For each noise level t in ``levels``: (t, the q, k, v [B, H, N, D] of every video self-attention call) of one
    forward of ``clips`` noisy clips of the model's data at its current clip shape, in 3D-tiled order unless
    ``tiled=False`` (see :class:`QKVRecorder`). The clips and the noise are drawn once, from ``seed``."""
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    video, captions = model.data.sample(clips, gen, device)
    noise = torch.randn(video.shape, generator=gen).to(device)
    tokens = model.tokenize(captions).to(device)
    for level in levels:
        t = torch.full((clips,), level, device=device)
        recorder = QKVRecorder(token_grid(model), device, tiled=tiled)
        with SDPAInterceptor(recorder), torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda"):
            model(noisy(video, noise, t), t, tokens)
        yield level, recorder.calls


def measure(model: BuiltinVideoDiT, clip, clips: int = 2, seed: int = 10_000) -> dict:
    """Oracle metrics per noise level and layer on ``clips`` held-out clips of shape ``clip``."""
    model.use_clip(*clip)
    per_level = {str(level): [oracle_metrics(*call) for call in calls]
                 for level, calls in recorded_attention(model, clips, seed, NOISE_LEVELS)}
    return {"clip": list(clip), "tokens": math.prod(token_grid(model)), "per_level": per_level,
            "summary": summarise(per_level)}


def summarise(per_level: dict) -> dict:
    """Means over layers and noise levels, and per layer (over levels)."""
    layers = len(next(iter(per_level.values())))
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    out = {"recall": {}, "output_error": {}}
    for key, grid in (("recall", SPARSITIES), ("output_error", ERROR_SPARSITIES)):
        for s in grid:
            out[key][str(s)] = mean([call[key][str(s)] for calls in per_level.values() for call in calls])
    out["recall_per_layer"] = {"0.95": [mean([calls[i]["recall"]["0.95"] for calls in per_level.values()])
                                        for i in range(layers)]}
    out["recall_95_per_level"] = {level: mean([c["recall"]["0.95"] for c in calls])
                                  for level, calls in per_level.items()}
    out["sparsity_at_recall"] = mean([c["sparsity_at_recall"] for calls in per_level.values() for c in calls])
    return out


def table(results: dict) -> str:
    head = ("| variant | after | clip | steps | loss | recall 90 / 95 / 97% | output error 90 / 95 / 97% | "
            "recall 95% per layer |\n|---|---|---|---|---|---|---|---|\n")
    rows = []
    for name, r in results.items():
        for m in r["measurements"]:
            s, phases = m["summary"], r["phases"][: m["after_phase"] + 1]
            rows.append(f"| {name} | phase {m['after_phase']} | {'x'.join(map(str, m['clip']))} | "
                        f"{sum(p['steps'] for p in phases)} | {phases[-1]['final_loss']:.4f} | "
                        + " / ".join(f"{s['recall'][str(x)]:.3f}" for x in ERROR_SPARSITIES) + " | "
                        + " / ".join(f"{s['output_error'][str(x)]:.3f}" for x in ERROR_SPARSITIES) + " | "
                        + " ".join(f"{x:.2f}" for x in s["recall_per_layer"]["0.95"]) + " |")
    return head + "\n".join(rows) + "\n"


def measure_model(directory: Path, out: Path, clips=(SHORT, LONG), device: str = "cuda") -> int:
    """Oracle metrics of a trained model (``load_builtin(directory)``) on short and long clips."""
    from ..model.builtin import load_builtin

    model = load_builtin(directory, device=device)
    phases = model.config.get("phases") or [model.config.get("training") or {"steps": 0, "final_loss": float("nan")}]
    measured = [dict(measure(model, clip), after_phase=len(phases) - 1) for clip in clips]
    results = {directory.name: {"phases": phases, "measurements": measured}}
    (out / "oracle.json").write_text(json.dumps(
        {**run_metadata(device, noise_levels=NOISE_LEVELS), "model": results}, indent=1))
    print(table(results))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seconds", type=float, default=75.0, help="training budget of one budget share")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--model", type=Path, default=None,
                        help="measure the model in this directory on short and long clips instead of training")
    parser.add_argument("--short-only", action="store_true", help="with --model: short clips only (CPU-friendly)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.model is not None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        return measure_model(args.model, args.out, (SHORT,) if args.short_only else (SHORT, LONG), device)
    if not torch.cuda.is_available():
        raise SystemExit("error: the study trains models and needs a CUDA GPU")
    torch.backends.cuda.matmul.allow_tf32 = True
    results = {}
    for name in args.variants.split(","):
        data, transformer, phases = VARIANTS[name]
        torch.manual_seed(0)
        model = BuiltinVideoDiT(model_config(data, transformer, SHORT)).cuda()
        print(f"{name}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters", flush=True)
        start = time.perf_counter()
        done, measured = [], []
        for index, (clip, batch, share) in enumerate(phases):
            done.append(train_phase(model, clip, batch, share * args.seconds, seed=index, lr=args.lr))
            model.eval()
            for measured_clip in sorted({SHORT, clip}):
                measured.append(dict(measure(model, measured_clip), after_phase=index))
        results[name] = {"data": data, "transformer": transformer, "phases": done, "measurements": measured,
                         "seconds": round(time.perf_counter() - start, 1)}
        (args.out / "study.json").write_text(json.dumps(
            {**run_metadata(budget_seconds=args.seconds, noise_levels=NOISE_LEVELS), "variants": results}, indent=1))
        (args.out / "study.md").write_text(table(results))
        print(table({name: results[name]}), flush=True)
    print(table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
