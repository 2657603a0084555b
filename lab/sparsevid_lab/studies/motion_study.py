"""Why does the built-in model not show the captioned motion? Sampler settings and equal-budget training levers,
measured by the dense caption faithfulness of sampled clips (above all its motion score).

Two parts, each on one GPU:

* ``sampler``: the trained model as it is, sampled with other settings (steps, guidance, time shift,
  scheduler); no training. If motion appears with more steps or another shift, the sampler was the limit.
* ``train``: warm restarts of the model, one per lever, each trained for the same wall-clock budget on short
  clips (dense, rectified flow), then sampled with the model's own sampler: ``baseline`` (the pre-training
  settings), ``high_noise`` (noise levels drawn with time shift 5 instead of 2: more training where the layout
  and the trajectories are decided), ``plain`` (backgrounds without texture or pan: is the texture in the way?),
  ``object_weight`` (the objects' pixels, ~5% of a clip, weigh 4x in the loss: is the background drowning them?),
  ``one_object`` and ``one_object_high_noise`` (clips of one object: no motion word to bind to the right one of
  several objects). Every lever is judged on the same evaluation captions (one to three objects).

    python3 -m sparsevid_lab.studies.motion_study --out OUT --part sampler [--model DIR]
    python3 -m sparsevid_lab.studies.motion_study --out OUT --part train --seconds 100 [--model DIR]

* ``captions``: does the model read the motion word at all? Flow-matching loss on the same noisy one-object
  clips with the true caption, the caption with one attribute's word swapped (motion, colour, shape, size) and
  the null caption, over the object's pixels; no training (runs on the CPU in minutes).

    python3 -m sparsevid_lab.studies.motion_study --out OUT --part captions [--clips 16]

* ``temporal``: does attention reach across frames? The share of each self-attention head's mass at each frame
  distance |f_query - f_key| (0: the query's own frame), on noisy clips of the model's data at the probe's
  noise levels, beside uniform attention; Wan's heads specialise into spatial (own frame) and temporal ones
  (runs on the CPU in minutes). Also writes OUT/motion_temporal.png.

    python3 -m sparsevid_lab.studies.motion_study --out OUT --part temporal [--clips 16]

* ``tracks``: how do the model's objects move? For each captioned motion, one-object captions drawn from the
  model's data, sampled with the model's own sampler, each object's centroid track read by the faithfulness
  scorer (net displacement, path length, the motion it reads as), beside ground-truth clips of the same
  captions: do the objects stand still, move the wrong way, or move too little? (runs on the CPU: about two
  minutes per motion at 4 clips).

    python3 -m sparsevid_lab.studies.motion_study --out OUT --part tracks [--clips 4]

* ``scratch``: can this architecture learn a captioned direction at all? A small model of it (4 layers, 2 heads
  of 64, 1.5M parameters) trained from scratch on the simplest data, 8 x 32 x 32 clips of one object sliding
  left, right, up or down on a plain background, then read as in ``tracks`` (runs on the CPU at about 1.9 s a
  step at batch 16).

    python3 -m sparsevid_lab.studies.motion_study --out OUT --part scratch --seconds 1800 --batch-size 16 --lr 5e-4

Writes OUT/motion_<part>.json and OUT/motion_<part>.md (sampler, train: one row per setting, faithfulness
overall and per attribute over the evaluation captions x seeds; captions: one row per noise level; temporal:
one row per layer and head; tracks, scratch: one row per motion; short clips 16 x 64 x 64 but in scratch).
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from .builtin_study import SHORT, model_config, recorded_attention, token_grid, train_phase
from benchmarks.run_info import run_metadata
from ..data import ProceduralVideos, grammar
from ..eval.faithfulness import SLIDE_DIRECTIONS, faithfulness
from ..eval.faithfulness_summary import summarize_faithfulness
from ..eval.harness import DEFAULT_CAPTIONS
from ..model.builtin import load_builtin
from ..model.builtin import BuiltinVideoDiT
from ..model.sampling import generate
from sparsevid.training.flow import noisy, weighted_squared_error

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
# (label, data overrides, time shift of the training noise levels, loss weight of the objects' pixels)
LEVERS = (
    ("baseline", {}, 2.0, 1.0),
    ("high_noise", {}, 5.0, 1.0),
    ("plain", {"background_texture": 0.0, "pan": 0.0}, 2.0, 1.0),
    ("object_weight", {}, 2.0, 4.0),
    ("one_object", {"max_objects": 1}, 2.0, 1.0),
    ("one_object_high_noise", {"max_objects": 1}, 5.0, 1.0),
)
ATTRIBUTES = ("background", "colour", "count", "size", "motion", "texture")
# (attribute, its place in a grammar object tuple (size, colour, texture, shape, motion), its word list)
SWAPS = (("motion", 4, grammar.MOTIONS), ("colour", 1, grammar.COLOURS), ("shape", 3, grammar.SHAPES),
         ("size", 0, grammar.SIZES))
NOISE_LEVELS = (0.3, 0.6, 0.9)
CAPTION_SEED = 123  # the probe's clips; its noise uses CAPTION_SEED + 1


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


def _captions(scenes, swap: tuple[int, tuple] | None) -> list[str]:
    """The one-object scenes' captions; ``swap`` (place, words): that attribute's word replaced by another one,
    a different one for each clip (clip b takes the word b % (len(words) - 1) + 1 places further on)."""
    captions = []
    for b in range(scenes.present.shape[0]):
        words = [int(getattr(scenes, f)[b, 0]) for f in ("size", "colour", "texture", "shape", "motion")]
        if swap is not None:
            place, vocabulary = swap
            words[place] = (words[place] + 1 + b % (len(vocabulary) - 1)) % len(vocabulary)
        captions.append(grammar.caption_text([tuple(words)], int(scenes.background[b])))
    return captions


def caption_use(model, clips: int, chunk: int = 4) -> dict:
    """{"object_share": the fraction of the clips' pixels the objects cover, "levels": per noise level t, the
    flow-matching loss over the object's pixels (where the clip differs from its object-free render) with the
    true caption, each swapped attribute and the null caption, {label: loss}}."""
    device, dtype = next(model.parameters()).device, next(model.parameters()).dtype
    data = ProceduralVideos(**{**model.data.config(), "max_objects": 1})
    scenes = data.sample_scenes(clips, torch.Generator().manual_seed(CAPTION_SEED))
    video = data.render(scenes)
    region = data.object_mask(scenes, video).float()  # [B, 1, T, H, W]
    noise = torch.randn(video.shape, generator=torch.Generator().manual_seed(CAPTION_SEED + 1))
    variants = {"true": _captions(scenes, None), "null": [""] * clips,
                **{f"swap {name}": _captions(scenes, (place, words)) for name, place, words in SWAPS}}
    rows = {}
    for t_value in NOISE_LEVELS:
        x_t, target = noisy(video, noise, torch.full((clips,), t_value)), noise - video
        row = {}
        for label, captions in variants.items():
            with torch.no_grad():
                prediction = torch.cat([
                    model(x_t[i:i + chunk].to(device, dtype), torch.full((len(captions[i:i + chunk]),), t_value,
                                                                          device=device),
                          model.tokenize(captions[i:i + chunk]).to(device)).float().cpu()
                    for i in range(0, clips, chunk)])
            row[label] = float(weighted_squared_error(prediction, target, region))
        rows[f"t {t_value}"] = row
        print(caption_table({f"t {t_value}": row}), flush=True)
    return {"object_share": float(region.mean()), "levels": rows}


def frame_distance_mass(q: torch.Tensor, k: torch.Tensor, frames: int, chunk: int = 512) -> torch.Tensor:
    """Attention mass float64 [H, frames] at each frame distance |f_query - f_key| = 0 .. frames - 1 (mean over the
    batch and the queries) for q, k [B, H, N, D] in the model's raster order, N = frames x tokens per frame."""
    batch, heads, n, dim = q.shape
    per_frame = n // frames
    frame = torch.arange(n, device=q.device) // per_frame
    total = torch.zeros(heads, frames, dtype=torch.float64, device=q.device)
    keys = k.float().transpose(-1, -2)
    for start in range(0, n, chunk):
        probs = torch.softmax(q[:, :, start:start + chunk].float() @ keys * dim ** -0.5, dim=-1)
        by_frame = probs.view(batch, heads, -1, frames, per_frame).sum(-1)  # [B, H, rows, frames]
        distance = (frame[start:start + chunk, None] - torch.arange(frames, device=q.device)).abs()
        by_distance = torch.zeros_like(by_frame).scatter_add_(-1, distance.expand_as(by_frame), by_frame)
        total += by_distance.sum((0, 2)).double()
    return total / (batch * n)


def uniform_frame_distance(frames: int) -> torch.Tensor:
    """The same shares float64 [frames] for attention spread evenly over every key."""
    distance = (torch.arange(frames)[:, None] - torch.arange(frames)).abs().flatten()
    ones = torch.ones(distance.numel(), dtype=torch.float64)
    return torch.zeros(frames, dtype=torch.float64).index_add_(0, distance, ones) / frames ** 2


def temporal_attention(model, clips: int) -> dict:
    """{"frames", "uniform": shares [frames], "levels": per noise level t, per layer, shares [H][frames]} of the
    video self-attention on ``clips`` noisy clips of the model's data (see :func:`frame_distance_mass`)."""
    frames = token_grid(model)[0]
    levels = {}
    for t_value, calls in recorded_attention(model, clips, CAPTION_SEED, NOISE_LEVELS, tiled=False):
        levels[f"t {t_value}"] = [frame_distance_mass(q, k, frames).tolist() for q, k, _ in calls]
        print(f"t {t_value}: {len(calls)} layers", flush=True)
    return {"frames": frames, "uniform": uniform_frame_distance(frames).tolist(), "levels": levels}


def mean_over_levels(result: dict) -> torch.Tensor:
    """The shares of :func:`temporal_attention`'s result averaged over its noise levels: [layers, H, frames]."""
    return torch.tensor(list(result["levels"].values())).mean(0)


DISTANCE_BINS = (("own frame", 0, 1), ("1 frame away", 1, 2), ("2-3 away", 2, 4), ("4+ away", 4, None))


def temporal_table(result: dict) -> str:
    """Per layer and head, the mass by frame distance (mean over the noise levels), and uniform attention's."""
    shares = mean_over_levels(result)
    uniform = torch.tensor(result["uniform"])

    def cells(row: torch.Tensor) -> str:
        return " | ".join(f"{float(row[lo:hi].sum()):.3f}" for _, lo, hi in DISTANCE_BINS)

    lines = ["| layer | head | " + " | ".join(label for label, _, _ in DISTANCE_BINS) + " |",
             "|---|---|" + "---|" * len(DISTANCE_BINS), f"| uniform attention | - | {cells(uniform)} |"]
    for layer, heads in enumerate(shares):
        lines += [f"| {layer} | {head} | {cells(row)} |" for head, row in enumerate(heads)]
    return "\n".join(lines) + "\n"


def plot_temporal(result: dict, path: Path) -> Path:
    """Mass by frame distance, one line per layer and head (mean over the noise levels), log scale."""
    from ..eval.plots import pyplot, save_figure

    plt = pyplot()
    shares = mean_over_levels(result)
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for layer, heads in enumerate(shares):
        for head, row in enumerate(heads):
            ax.plot(row.numpy(), color=plt.cm.viridis(layer / max(len(shares) - 1, 1)),
                    linestyle="-" if head == 0 else "--", label=f"layer {layer} head {head}")
    ax.plot(result["uniform"], color="black", linestyle=":", label="uniform")
    ax.set(yscale="log", xlabel="frame distance |f_query - f_key|", ylabel="attention mass",
           title="built-in model: where attention goes in time")
    ax.legend(fontsize=6, ncol=2)
    return save_figure(fig, path)


def caption_table(rows: dict) -> str:
    """Object-pixel loss per caption variant, and each variant's change against the true caption."""
    labels = list(next(iter(rows.values())))
    lines = ["| noise level | " + " | ".join(labels) + " |", "|---|" + "---|" * len(labels)]
    for level, row in rows.items():
        cells = [f"{row[label]:.4f}" + ("" if label == "true" else f" ({row[label] / row['true'] - 1:+.1%})")
                 for label in labels]
        lines.append(f"| {level} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


TRACK_SEED = 321  # the tracks part's captions (motion m: TRACK_SEED + m); the sampler's noise: seeds 0..clips-1
SLIDES = grammar.MOTIONS[:len(SLIDE_DIRECTIONS)]


def read_tracks(video: torch.Tensor, captions: list[str], motion: str) -> dict:
    """How the single objects of one-object clips ``video`` [B, 3, T, H, W] move, all captioned ``motion``:
    the mean motion score, "read_as" (how many tracks read as each motion, "none" where no membership reaches
    0.5, "not found" where the object is missing), and over the found objects the mean path length, "drift",
    the mean length of the net displacement (any direction), and "along", the mean net displacement in the
    captioned direction (slides; None for bouncing and circling), all in frame fractions."""
    objects = [s["objects"][0] for s in faithfulness(video, captions)]
    read_as: dict[str, int] = {}
    along, paths, drifts = [], [], []
    for entry in objects:
        reading = entry["motion_reading"]
        if reading is None:
            label = "not found"
        else:
            best = max(range(len(grammar.MOTIONS)), key=lambda m: reading["memberships"][m])
            label = grammar.MOTIONS[best] if reading["memberships"][best] >= 0.5 else "none"
            paths.append(reading["path"])
            drifts.append(math.hypot(*reading["net"]))
            if motion in SLIDES:
                along.append(float(SLIDE_DIRECTIONS[SLIDES.index(motion)] @ torch.tensor(reading["net"])))
        read_as[label] = read_as.get(label, 0) + 1
    mean = (lambda values: sum(values) / len(values) if values else None)
    return {"motion": mean([e["motion"] for e in objects]), "read_as": read_as, "along": mean(along),
            "drift": mean(drifts), "path": mean(paths)}


def motion_tracks(model, clips: int, motions=grammar.MOTIONS) -> dict:
    """Per motion (of the grammar, or ``motions``): {"captions", "model": read_tracks of the model's clips,
    "truth": read_tracks of the rendered clips of the same scenes}."""
    rows = {}
    for motion in motions:
        m = grammar.MOTIONS.index(motion)
        data = ProceduralVideos(**{**model.data.config(), "max_objects": 1, "motions": [motion]})
        scenes = data.sample_scenes(clips, torch.Generator().manual_seed(TRACK_SEED + m))
        captions = _captions(scenes, None)
        generated = generate(model, captions, list(range(clips)), progress=motion)
        rows[motion] = {"captions": captions, "model": read_tracks(generated, captions, motion),
                        "truth": read_tracks(data.render(scenes), captions, motion)}
        print(tracks_table({motion: rows[motion]}), flush=True)
    return rows


SCRATCH_CLIP = (8, 32, 32)


def scratch_model() -> BuiltinVideoDiT:
    """A small model of the built-in architecture (4 layers, 2 heads of 64, ~1.5M parameters) whose data are
    the simplest with a captioned direction: SCRATCH_CLIP clips of one object sliding on a plain background."""
    config = model_config({"max_objects": 1, "motions": list(SLIDES)},
                          {"attention_head_dim": 64, "freq_dim": 128, "ffn_dim": 512, "num_layers": 4}, SCRATCH_CLIP)
    return BuiltinVideoDiT(config)


def learn_from_scratch(clips: int, seconds: float, batch: int, lr: float, max_steps: int | None = None) -> dict:
    """{"training": the loss summary, "tracks": motion_tracks of the four slides} of a scratch_model trained
    (seed 0) for ``seconds`` (at most ``max_steps``) at ``batch`` clips a step."""
    torch.manual_seed(0)
    model = scratch_model().train()
    training = train_phase(model, SCRATCH_CLIP, batch, seconds, seed=0, lr=lr, max_steps=max_steps)
    return {"training": training, "tracks": motion_tracks(model.eval(), clips, SLIDES)}


def tracks_table(rows: dict) -> str:
    """One row per motion: the model's clips beside the ground truth of the same captions."""
    def cells(reading: dict) -> str:
        counts = ", ".join(f"{label} {n}" for label, n in sorted(reading["read_as"].items(), key=lambda kv: -kv[1]))
        along = "-" if reading["along"] is None else f"{reading['along']:+.3f}"
        drift, path = ("-" if reading[k] is None else f"{reading[k]:.3f}" for k in ("drift", "path"))
        return f"{reading['motion']:.3f} | {counts} | {along} | {drift} | {path}"
    columns = ("score", "read as", "net along", "drift", "path")
    head = ("| captioned motion | " + " | ".join(f"{who}: {c}" for who in ("model", "truth") for c in columns)
            + " |\n|---|" + "---|" * 2 * len(columns) + "\n")
    return head + "\n".join(f"| {motion} | {cells(r['model'])} | {cells(r['truth'])} |" for motion, r in rows.items()) + "\n"


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
    if args.part == "scratch":
        return learn_from_scratch(args.clips, args.seconds, args.batch_size, args.lr, args.max_steps)
    if args.part != "train":  # the model as it is, at the short clip
        model = load_builtin(args.model, device=device, dtype=dtype)
        model.use_clip(*SHORT)
    if args.part == "captions":
        return caption_use(model, args.clips)
    if args.part == "temporal":
        return temporal_attention(model, args.clips)
    if args.part == "tracks":
        return motion_tracks(model, args.clips)
    if args.part == "sampler":
        for label, overrides in SAMPLERS[: args.limit]:
            rows[label] = dict(evaluate(model, **overrides), sampler=overrides)
            print(table({label: rows[label]}), flush=True)
        return rows
    chosen = [lever for lever in LEVERS if args.levers is None or lever[0] in args.levers]
    for label, data, shift, object_weight in chosen[: args.limit]:
        model = load_builtin(args.model, device=device)  # trained in fp32 (bf16 autocast on CUDA), sampled in bf16
        model.train()
        training = train_phase(model, SHORT, args.batch_size, args.seconds, seed=0, lr=args.lr, shift=shift,
                               max_steps=args.max_steps, object_weight=object_weight, data_options=data)
        model.eval().to(dtype)  # judged on the same captions whatever it trained on: the model's data are unchanged
        rows[label] = dict(evaluate(model, steps=args.sample_steps), training=training, data=data, train_shift=shift,
                           object_weight=object_weight)
        print(table({label: rows[label]}), flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--part", choices=("sampler", "train", "captions", "temporal", "tracks", "scratch"),
                        required=True)
    parser.add_argument("--model", type=Path, default=None, help="model directory (default: the shipped model)")
    parser.add_argument("--seconds", type=float, default=100.0,
                        help="training budget of each lever (part train) or of the scratch model")
    parser.add_argument("--max-steps", type=int, default=None, help="step cap of each lever (a CPU smoke run)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--sample-steps", type=int, default=None, help="sampler steps after training (default: the model's)")
    parser.add_argument("--levers", nargs="+", choices=[lever[0] for lever in LEVERS], default=None,
                        help="part train: these levers only (default: all)")
    parser.add_argument("--limit", type=int, default=None, help="only the first N settings (a CPU smoke run)")
    parser.add_argument("--clips", type=int, default=None,
                        help="clips of the captions (one object each) and temporal parts (default 16); per motion "
                             "in the tracks and scratch parts (default 4)")
    args = parser.parse_args()
    if args.clips is None:
        args.clips = 4 if args.part in ("tracks", "scratch") else 16
    args.out.mkdir(parents=True, exist_ok=True)
    rows = run_part(args)
    probe = args.part in ("captions", "temporal", "tracks", "scratch")
    seeds = {"captions": [CAPTION_SEED, CAPTION_SEED + 1], "temporal": [CAPTION_SEED],
             "tracks": [TRACK_SEED, *range(args.clips)], "scratch": [0, TRACK_SEED, *range(args.clips)]}
    scratch = args.part == "scratch"
    meta = run_metadata(model="scratch" if scratch else str(args.model or "shipped"),
                        clip=list(SCRATCH_CLIP if scratch else SHORT), part=args.part,
                        seeds=seeds.get(args.part, list(SEEDS)),
                        seconds=args.seconds if args.part in ("train", "scratch") else None,
                        clips=args.clips if probe else None)
    if args.part == "captions":
        text = f"Objects cover {rows['object_share']:.1%} of the pixels.\n\n" + caption_table(rows["levels"])
    elif args.part == "tracks":
        text = tracks_table(rows)
    elif scratch:
        t = rows["training"]
        text = (f"Trained from scratch: {t['steps']} steps x batch {t['batch']} in {t['seconds']} s, final loss "
                f"{t['final_loss']:.4f}.\n\n" + tracks_table(rows["tracks"]))
    elif args.part == "temporal":
        text = temporal_table(rows)
        plot_temporal(rows, args.out / "motion_temporal.png")
    else:
        text = table(rows)
    (args.out / f"motion_{args.part}.json").write_text(json.dumps({**meta, "settings": rows}, indent=1))
    (args.out / f"motion_{args.part}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
