"""The quality harness: generate clips with dense attention and with sparse configurations, and compare.

For a fixed list of (caption, seed) pairs it samples every clip densely and under each
:class:`~sparsevid.SparseConfig`, then reports per configuration:

* achieved sparsity: mean video-to-video sparsity over all self-attention calls of all steps
  (calls a schedule keeps dense count as 0),
* PSNR and SSIM of each clip against the dense clip of the same caption and seed,
* attention recall and relative L1 of the attention output per layer, measured on the real q, k, v
  that the dense run feeds its self-attentions at a few probe steps (the configuration's mask is
  predicted from them exactly as the sparse processor would),
* wall time of sampling (and the ratio to dense), the time of all self-attention calls (``attention_s``,
  search included) and the part of it spent searching masks (``search_s``: mask prediction, near zero for
  masks a training-free config reuses) with the number of sparse calls by mask source (predicted, reused,
  within, exact).
"""
from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

DEFAULT_CAPTIONS = (
    "big red plain circle moving right on a black background",
    "small yellow striped square bouncing and big blue plain ring circling on a gray background",
    "big white checkered diamond moving down on a navy background",
    "big green striped square moving left and small magenta plain circle moving up on a beige background",
    "small cyan plain ring moving left and big orange checkered circle bouncing on a black background",
    "big magenta striped diamond circling and small white plain square moving right and "
    "small green checkered ring bouncing on a gray background",
)


@dataclass
class _Probe:
    """Per-layer recall / relative-L1 sums of one configuration over the probed attention calls."""

    recall: dict[int, list[float]] = field(default_factory=dict)
    rel_l1: dict[int, list[float]] = field(default_factory=dict)

    def add(self, layer: int, recall: float, rel_l1: float) -> None:
        self.recall.setdefault(layer, []).append(recall)
        self.rel_l1.setdefault(layer, []).append(rel_l1)

    def summary(self) -> dict:
        mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
        layers = sorted(self.recall)
        return {"recall_per_layer": [mean(self.recall[i]) for i in layers],
                "rel_l1_per_layer": [mean(self.rel_l1[i]) for i in layers],
                "recall": mean([mean(self.recall[i]) for i in layers]) if layers else None,
                "rel_l1": mean([mean(self.rel_l1[i]) for i in layers]) if layers else None}


def probe_layer(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, runtime, position, grid: tuple[int, int, int],
                scale: float | None, measure: bool = True) -> tuple[float, float] | None:
    """(recall, relative L1) of the mask a layer's runtime gives one self-attention call q, k, v [B, H, N, D]
    over a (T, H, W) token grid at ``position`` (a ``StepPosition``), exactly as the sparse processor gets it
    (the same ``LayerRuntime``: plan of the step, mask reuse); (1.0, 0.0) if dense. ``measure=False`` only
    advances the runtime (a reused mask needs the steps before the probed one) and returns None."""
    from sparsevid.integration.token_order import tile_order
    from sparsevid.eval.metrics import attention_recall, sparse_output_error

    plan = runtime.begin(position)
    if plan is None:
        return (1.0, 0.0) if measure else None
    if plan.tile != "none":
        order = tile_order(grid, plan.tile, q.device)
        q, k, v = (t.index_select(2, order.perm) for t in (q, k, v))
    mask = runtime.mask(q, k, scale)
    if not measure:
        return None
    recall = float(attention_recall(q, k, mask, scale=scale).mean())
    return recall, sparse_output_error(q, k, v, mask, scale=scale, backend=plan.backend)["relative_l1"]


class SelfAttentionProbe:
    """During a forward, routes every video self-attention SDPA call through :func:`probe_layer` for each
    configuration (measured at the probe steps; configurations that reuse masks follow every step), then
    computes the attention itself. At the probe steps each call is also handed to ``on_attention(layer, step,
    q, k, v, scale, timestep)`` (e.g. :meth:`~sparsevid.eval.oracle.OracleStudy.add`); ``on_probe()`` is called
    after each probed step (the last one on :meth:`finish`)."""

    def __init__(self, configs: dict, probes: dict[str, _Probe], grid: tuple[int, int, int],
                 probe_steps: Sequence[int], on_attention=None, on_probe=None):
        self.configs, self.probes, self.grid, self.probe_steps = configs, probes, grid, set(probe_steps)
        self.on_attention, self.on_probe = on_attention, on_probe
        self.video_tokens = grid[0] * grid[1] * grid[2]
        self.runtimes: dict[tuple[str, int], object] = {}  # (config name, layer) -> LayerRuntime
        self.step = self.layer = 0
        self.timestep = None
        self.seconds = 0.0  # time spent probing (excluded from the dense wall time)

    def on_step(self, i: int, t: float) -> None:
        """Sampler callback: step ``i`` begins at noise level ``t`` (model timestep ``1000 t``)."""
        self.finish()
        self.step, self.layer, self.timestep = i, 0, 1000.0 * t

    def finish(self) -> None:
        """Report the step that ran last as complete (called by :meth:`on_step` and after the sampling)."""
        if self.on_probe is not None and self.step in self.probe_steps and self.layer:
            self.on_probe()
        self.layer = 0

    def __call__(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kwargs):
        from sparsevid.plan.runtime import LayerRuntime, StepPosition

        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, **kwargs)
        if query.shape[2] == key.shape[2] == self.video_tokens:  # a video self-attention (cross-attention has caption keys)
            start = time.perf_counter()
            measure = self.step in self.probe_steps
            position = StepPosition(self.step, self.timestep)
            for name, config in self.configs.items():
                if not (measure or config.varies_with_step):
                    continue
                runtime = self.runtimes.setdefault((name, self.layer), LayerRuntime(self.layer, config))
                result = probe_layer(query, key, value, runtime, position, self.grid, scale, measure)
                if result is not None:
                    self.probes[name].add(self.layer, *result)
            if measure and self.on_attention is not None:
                self.on_attention(self.layer, self.step, query, key, value, scale, self.timestep)
            self.seconds += time.perf_counter() - start
            self.layer += 1
        return out


def timed_generate(model, captions: Sequence[str], seeds: Sequence[int], steps: int | None, guidance: float | None,
                   on_step=None, progress: bool | str = False) -> tuple[torch.Tensor, float]:
    """Clips float32 [B, 3, T, H, W] sampled by :func:`~sparsevid_lab.model.sampling.generate` (``progress``: its
    per-step progress bar), and the wall time in seconds (the device is synchronised before the clock starts;
    ``generate`` returns CPU tensors)."""
    from ..model.sampling import generate

    device = next(model.parameters()).device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    video = generate(model, list(captions), list(seeds), steps=steps, guidance=guidance, on_step=on_step,
                     progress=progress)
    return video, time.perf_counter() - start


def sample_dense(model, jobs: Sequence[tuple[str, int]], steps: int | None,
                 guidance: float | None) -> tuple[torch.Tensor, float]:
    """Clips float32 [len(jobs), 3, T, H, W] of the (caption, seed) ``jobs`` sampled with ``model`` as it is
    (dense, unless sparse attention is applied), one clip at a time as :func:`sample_with_stats` samples them (so
    that batching does not set dense and sparse runs apart), and the sampling wall time in seconds."""
    clips, seconds = [], 0.0
    for caption, seed in jobs:
        clip, dt = timed_generate(model, [caption], [seed], steps, guidance)
        clips.append(clip)
        seconds += dt
    return torch.cat(clips), seconds


def sample_with_stats(model, config, jobs: Sequence[tuple[str, int]], steps: int | None, guidance: float | None,
                      on_clip=None, progress: bool | str = False) -> tuple[torch.Tensor, float, list[dict]]:
    """Sample each (caption, seed) of ``jobs``, one clip at a time, under ``config``'s sparse attention (removed
    after). Returns the clips float32 [len(jobs), 3, T, H, W], the sampling wall time in seconds and the stats
    of every self-attention call (:func:`~sparsevid.attention_stats` dicts, read from the device after the
    timed sampling). ``on_clip()`` is called after each clip; ``progress`` shows a bar over each clip's steps."""
    from sparsevid.integration import apply_sparse_attention, remove_sparse_attention, reset_denoising_step
    from sparsevid.integration.switch import attention_records

    transformer = model.transformer
    apply_sparse_attention(transformer, config, collect_stats=True)
    per_forward: list[list] = []  # raw records; read from the device only after the timed sampling
    hook = transformer.register_forward_hook(lambda *_: per_forward.append(attention_records(transformer)))
    try:
        videos, seconds = [], 0.0
        for caption, seed in jobs:
            reset_denoising_step(transformer)
            video, dt = timed_generate(model, [caption], [seed], steps, guidance, progress=progress)
            videos.append(video)
            seconds += dt
            if on_clip is not None:
                on_clip()
    finally:
        hook.remove()
        remove_sparse_attention(transformer)
    return torch.cat(videos), seconds, [record.as_dict() for records in per_forward for record in records]


def summarize_calls(calls: list[dict]) -> dict:
    """Over self-attention call stats: mean sparsity (dense calls count 0), total attention time
    (``attention_s``: every call's whole attention, search included) and search time (``search_s``: mask
    prediction) in seconds, and the number of sparse calls by mask source."""
    return {"sparsity": sum(r["sparsity"] for r in calls) / len(calls),
            "attention_s": sum(r["attention_ms"] or 0.0 for r in calls) / 1e3,
            "search_s": sum(r["predict_ms"] or 0.0 for r in calls) / 1e3,
            "mask_sources": dict(collections.Counter(r["mask_source"] for r in calls if "mask_source" in r))}


def video_token_grid(model) -> tuple[int, int, int]:
    """The (T, H, W) grid of video tokens of a built-in ``model``'s clips: clip shape over patch size."""
    return tuple(s // p for s, p in zip(model.clip_shape[1:], model.transformer.config.patch_size))


def resolve_probe_steps(steps: int, probe_steps: Sequence[int] | None = None) -> list[int]:
    """The sorted distinct denoising steps to probe out of ``steps``: ``probe_steps``, by default the first,
    middle and last step. ValueError if one lies outside [0, steps)."""
    probe_steps = sorted({0, steps // 2, steps - 1}) if probe_steps is None else sorted(set(probe_steps))
    if any(not 0 <= s < steps for s in probe_steps):
        raise ValueError(f"probe_steps must lie in [0, {steps}), got {probe_steps}")
    return probe_steps


def run_harness(model, configs: dict, captions: Sequence[str] = DEFAULT_CAPTIONS[:4], seeds: Sequence[int] = (0,),
                steps: int = 10, guidance: float | None = None, probe_steps: Sequence[int] | None = None,
                probe_clips: int = 1, progress: bool = True, bar=None, on_attention=None, on_probe=None) -> dict:
    """Compare sparse configurations against dense sampling (see the module docstring).

    model: a BuiltinVideoDiT; configs: {label: SparseConfig}. Every caption is sampled with every seed.
    probe_steps: denoising steps whose attention inputs are probed (default: first, middle, last);
    probe_clips: how many of the clips are probed. bar: a tqdm bar to advance once per sampled clip (then
    ``progress`` is ignored and the bar left open), else the harness draws its own. on_attention(layer, step,
    q, k, v, scale, timestep): given every video self-attention call of the dense probe clips at the probe
    steps (e.g. :meth:`~sparsevid.eval.oracle.OracleStudy.add`); on_probe(): called after each probed step of
    each probe clip. Returns a JSON-compatible dict with "settings",
    "dense" and one entry per configuration under "configs"; "clips" holds the sampled videos
    (label -> float32 [n_clips, 3, T, H, W]) and is not JSON.
    """
    from tqdm.auto import tqdm

    from sparsevid.integration.processors import SDPAInterceptor
    from sparsevid.eval.video_metrics import psnr, ssim

    if not configs:
        raise ValueError("configs must name at least one sparse configuration")
    if not captions or not seeds:
        raise ValueError("captions and seeds must not be empty")
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive int, got {steps!r}")
    guidance = model.config["sampling"]["guidance"] if guidance is None else guidance
    probe_steps = resolve_probe_steps(steps, probe_steps)
    grid = video_token_grid(model)
    jobs = [(c, s) for c in captions for s in seeds]
    probes = {name: _Probe() for name in configs}
    own_bar = bar is None
    if own_bar:
        bar = tqdm(total=len(jobs) * (1 + len(configs)), desc="harness", disable=not progress)

    dense_clips, dense_seconds = [], 0.0
    for index, (caption, seed) in enumerate(jobs):
        if index < probe_clips:
            probe = SelfAttentionProbe(configs, probes, grid, probe_steps, on_attention, on_probe)
            with SDPAInterceptor(probe):
                video, seconds = timed_generate(model, [caption], [seed], steps, guidance, on_step=probe.on_step)
            seconds -= probe.seconds
            probe.finish()
        else:
            video, seconds = timed_generate(model, [caption], [seed], steps, guidance)
        dense_clips.append(video)
        dense_seconds += seconds
        bar.update()
    dense = torch.cat(dense_clips)
    results = {"settings": {"captions": list(captions), "seeds": list(seeds), "steps": steps, "guidance": guidance,
                            "probe_steps": probe_steps, "probe_clips": min(probe_clips, len(jobs)),
                            "grid": list(grid), "device": str(next(model.parameters()).device)},
               "dense": {"seconds": dense_seconds}, "configs": {}}
    clips = {"dense": dense}

    for name, config in configs.items():
        sparse, seconds, calls = sample_with_stats(model, config, jobs, steps, guidance, on_clip=bar.update)
        clips[name] = sparse
        p, s = psnr(sparse, dense), ssim(sparse, dense)
        results["configs"][name] = {
            "config": config.to_dict(), **summarize_calls(calls), "seconds": seconds,
            "speedup": dense_seconds / seconds, "psnr": float(p.mean()), "ssim": float(s.mean()),
            "psnr_per_clip": p.tolist(), "ssim_per_clip": s.tolist(), **probes[name].summary()}
    if own_bar:
        bar.close()
    results["clips"] = clips
    return results


def markdown_table(results: dict) -> str:
    """The per-configuration summary of :func:`run_harness` results as a Markdown table."""
    settings = results["settings"]
    lines = [f"{len(settings['captions'])} captions x {len(settings['seeds'])} seeds, {settings['steps']} steps, "
             f"guidance {settings['guidance']}, device {settings['device']}; dense sampling "
             f"{results['dense']['seconds']:.1f} s",
             "",
             "| config | sparsity | PSNR (dB) | SSIM | recall | rel. L1 | time (s) | vs dense |",
             "|---|---|---|---|---|---|---|---|"]
    for name, r in results["configs"].items():
        lines.append(f"| `{name}` | {r['sparsity']:.3f} | {r['psnr']:.2f} | {r['ssim']:.4f} | "
                     f"{_fmt(r['recall'], '.4f')} | {_fmt(r['rel_l1'], '.4f')} | {r['seconds']:.1f} | "
                     f"{r['speedup']:.2f}x |")
    lines += ["", "Per layer (recall / relative L1 of the attention output, probe steps "
              f"{settings['probe_steps']}):", "", "| config | " + " | ".join(
                  f"layer {i}" for i in range(_num_layers(results))) + " |",
              "|---|" + "---|" * _num_layers(results)]
    for name, r in results["configs"].items():
        cells = [f"{a:.3f} / {b:.3f}" for a, b in zip(r["recall_per_layer"], r["rel_l1_per_layer"])]
        lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _num_layers(results: dict) -> int:
    return max((len(r["recall_per_layer"]) for r in results["configs"].values()), default=0)


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)
