"""Rule settings that reach a target sparsity on a model's own attention.

Top-k reaches a sparsity by construction (it keeps the fraction 1 - s of the key blocks, rounded up); top-p
and the hybrid rule reach one only through the attention they see. :func:`calibrate_rules` takes the video
self-attention q, k recorded from a model's dense forward passes (3D-tiled token order, as the sparse processors
see them) and finds, by bisection on p, the top-p threshold (and the hybrid's, with top-k (1 - s) / 2) whose
predicted masks have mean sparsity s over those calls.

Per head: :func:`calibrate_heads` runs a dense transformer and measures, for every self-attention layer, head
and candidate setting, the achieved sparsity, the head's attention-output error and the exact attention mass
kept (:class:`HeadMeter`); :class:`~sparsevid.plan.calibration.Calibration` chooses each head's setting from
those measurements and makes the per-head ``SparseConfig``.
"""
from __future__ import annotations

import collections
from pathlib import Path
from typing import Callable, Iterable, Sequence

import torch

from ..ops import DEFAULT_BLOCK_K, DEFAULT_BLOCK_Q
from ..plan.noise_ranges import (NoiseRangeCalibration, check_splits, check_timestep_scale, range_bounds,
                                 range_index, range_label)

BISECTION_STEPS = 14


def mean_sparsity(calls, block_q: int = DEFAULT_BLOCK_Q, block_k: int = DEFAULT_BLOCK_K, **rule) -> float:
    """Mean sparsity of the masks ``sparsevid.predict_mask(q, k, **rule)`` predicts over recorded ``calls``."""
    from ..ops import predict_mask

    return sum(predict_mask(q, k, block_q=block_q, block_k=block_k, **rule)[0].sparsity for q, k in calls) / len(calls)


def calibrate_topp(calls, target: float, topk: float | None = None, **blocks) -> float:
    """p in (0, 1] whose mean predicted sparsity over ``calls`` is closest to ``target`` (bisection); the top-p
    rule, or the hybrid rule with ``topk``."""
    rule = dict(rule="topp") if topk is None else dict(rule="hybrid", topk=topk)
    low, high = 1e-4, 1.0
    for _ in range(BISECTION_STEPS):
        mid = (low + high) / 2
        if mean_sparsity(calls, topp=mid, **rule, **blocks) > target:
            low = mid  # too sparse: keep more mass
        else:
            high = mid
    return (low + high) / 2


def check_targets(targets: Sequence[float]) -> None:
    if not targets or not all(isinstance(s, (int, float)) and 0 < s < 1 for s in targets):
        raise ValueError(f"targets must be sparsities in (0, 1), got {targets!r}")


def calibrate_rules(calls, targets: Sequence[float], block_q: int = DEFAULT_BLOCK_Q,
                    block_k: int = DEFAULT_BLOCK_K) -> dict:
    """{label: SparseConfig}: top-k, top-p and hybrid at every target sparsity in ``targets`` (each in (0, 1)),
    calibrated on recorded ``calls`` (:func:`record_video_attention`); labels like "topp 90%"."""
    from ..plan import SparseConfig

    check_targets(targets)
    blocks = dict(block_q=block_q, block_k=block_k)
    configs = {}
    for target in targets:
        keep = round(1.0 - target, 6)  # 6 places: 1 - 0.953125 is 3 of 64 key blocks, not 0.0469 (4 of 64)
        configs[f"topk {target:.0%}"] = SparseConfig(rule="topk", topk=keep, **blocks)
        configs[f"topp {target:.0%}"] = SparseConfig(rule="topp", topp=round(calibrate_topp(calls, target, **blocks), 5),
                                                     **blocks)
        configs[f"hybrid {target:.0%}"] = SparseConfig(
            rule="hybrid", topk=keep / 2, topp=round(calibrate_topp(calls, target, keep / 2, **blocks), 5), **blocks)
    return configs


# --------------------------------------------------------------------------- per-head calibration

class HeadMeter:
    """Sums, per self-attention layer, head and candidate setting, of the achieved sparsity, the relative L1 error of
    the head's attention output, its absolute error (mean |difference| per output element: a head whose output is
    small moves the layer's little), its output error (the L2 norm of the head's error pushed through its slice of
    the layer's output projection, relative to that of the layer's whole dense output: what the head moves the
    layer's output by) and the exact attention mass kept, over the attention calls :meth:`add` sees.

    heads: the heads of each layer; candidates: :class:`~sparsevid.plan.calibration.Candidate` s (each predicted
    with the hybrid rule and its budgets, as the calibrated configuration will); block_q, block_k: the tiles;
    backend: the attention backend (its predictor goes with it, as in ``LayerPlan``).
    """

    def __init__(self, heads: Sequence[int], candidates, block_q: int = DEFAULT_BLOCK_Q,
                 block_k: int = DEFAULT_BLOCK_K, backend: str = "auto"):
        from ..plan.config import PREDICT_BACKENDS

        self.heads, self.candidates = list(heads), tuple(candidates)
        self.block_q, self.block_k, self.backend = block_q, block_k, backend
        self.predict_backend = PREDICT_BACKENDS[backend]
        self.sums = {name: [torch.zeros(h, len(self.candidates), dtype=torch.float64) for h in self.heads]
                     for name in ("sparsity", "error", "abs_error", "output_error", "recall")}
        self.calls = [0] * len(self.heads)
        self.unprojected: set[int] = set()  # layers measured without an output projection
        self.grams: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # per layer: _projection_grams, made once

    def _layer_sums(self, layer: int, device: torch.device) -> dict[str, torch.Tensor]:
        """float64 [H, C] sums of ``layer`` on ``device`` (moved there once): the candidates add to them without a
        host copy, so that a layer call's candidates run back to back on the device."""
        for tables in self.sums.values():
            tables[layer] = tables[layer].to(device)
        return {name: tables[layer] for name, tables in self.sums.items()}

    @torch.no_grad()
    def add(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
            projection: torch.Tensor | None = None, text: tuple | None = None) -> None:
        """Measure one call q, k, v [B, H, N, D] of ``layer``'s video tokens (in the token order the masks refer to);
        ``projection``: the layer's output projection weight [C, H * D], the same at each of the layer's calls (its
        Gram matrices are kept from the first; None: the output error is not measured, NaN). ``text``: of a joint
        text-video attention, (k_text, v_text [B, H, Nt, D], valid text keys per batch entry or None): the video rows
        also attend them densely, as the sparse layers do, and the errors are of those rows' joint output (the
        recall stays the mass kept among the video keys)."""
        from ..integration.joint_attention import attend_text_keys, merge_partials
        from ..ops import block_sparse_attention, predict_mask
        from .oracle import ExactTiles

        if q.shape[1] != self.heads[layer]:
            raise ValueError(f"layer {layer} has {self.heads[layer]} heads, the call {q.shape[1]}")
        tiles = ExactTiles.measure(q, k, v, self.block_q, self.block_k, scale, self.backend)
        joint = None
        if text is not None:
            joint = attend_text_keys(q, *text, self.block_q, self.block_k, scale, self.backend)
        reference = (tiles.out if joint is None else merge_partials(tiles.out, tiles.lse, *joint)).float()
        reference_l1 = reference.abs().sum(dim=(0, 2, 3)).double()  # [H]
        rows = _row_weights(q.shape[2], self.block_q, tiles.mass.device)
        sums = self._layer_sums(layer, tiles.mass.device)
        if projection is None:
            gram = None
            self.unprojected.add(layer)
        else:
            heads, head_dim = q.shape[1], v.shape[-1]
            if projection.dim() != 2 or projection.shape[1] != heads * head_dim:
                raise ValueError(f"projection must be a weight [C, {heads * head_dim}] (heads x head dim), got "
                                 f"{tuple(projection.shape)}")
            if layer not in self.grams:  # the weights do not change while measuring
                self.grams[layer] = _projection_grams(projection, heads, head_dim)
            gram, layer_gram = self.grams[layer]
            reference_l2 = _projected_norm(reference, layer_gram)
        for c, candidate in enumerate(self.candidates):
            if candidate.rule == "dense":  # every tile kept: the dense output
                sums["recall"][:, c] += 1.0
                continue
            topk, topp = candidate.budgets
            mask, _ = predict_mask(q, k, rule="hybrid", topk=topk, topp=topp, block_q=self.block_q,
                                   block_k=self.block_k, scale=scale, backend=self.predict_backend)
            if joint is None:
                out = block_sparse_attention(q, k, v, mask, scale=scale, backend=self.backend).float()
            else:
                out = merge_partials(*block_sparse_attention(q, k, v, mask, scale=scale, backend=self.backend,
                                                             return_lse=True), *joint).float()
            l1 = (out - reference).abs().sum(dim=(0, 2, 3)).double()  # [H]
            error = l1 / reference_l1.clamp_min(1e-30)
            kept = (tiles.mass.double() * mask.keep.to(tiles.mass.device)).sum(dim=-1)  # [B, H, QB]
            sums["error"][:, c] += error
            sums["abs_error"][:, c] += l1 / (out.numel() // out.shape[1])
            if gram is not None:
                projected = _projected_norms(out - reference, gram).sqrt() / reference_l2.clamp_min(1e-30)
                sums["output_error"][:, c] += projected.to(sums["output_error"].device)
            sums["sparsity"][:, c] += mask.sparsity_per_head.mean(dim=0).to(sums["sparsity"].device)
            sums["recall"][:, c] += (kept * rows).sum(dim=-1).mean(dim=0)
        self.calls[layer] += 1

    def means(self) -> dict[str, list]:
        """{"sparsity", "error", "abs_error", "output_error", "recall": [layer][head][candidate] means over the calls;
        "output_error" None where a call came without a projection}; ValueError naming the layers no call was
        measured in."""
        missing = [layer for layer, n in enumerate(self.calls) if n == 0]
        if missing:
            raise ValueError(f"no video self-attention call was measured in layers {missing}: the forwards did not "
                             f"run them")
        means = {name: [(table.cpu() / n).tolist() for table, n in zip(tables, self.calls)]
                 for name, tables in self.sums.items()}
        if self.unprojected:
            means["output_error"] = None
        return means


def _projection_grams(projection: torch.Tensor, heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 (W_h^T W_h [H, D, D] of each head's slice W_h [C, D], W^T W [H * D, H * D]) of an output projection
    weight W [C, H * D]."""
    weight = projection.detach().double().contiguous()  # a column slice of a shared projection is strided
    slices = weight.view(weight.shape[0], heads, head_dim).transpose(0, 1)  # [H, C, D]
    return slices.transpose(1, 2) @ slices, weight.T @ weight


def _projected_norms(x: torch.Tensor, gram: torch.Tensor) -> torch.Tensor:
    """float64 [H]: ||x_h W_h^T||^2 of each head's part x_h of x [B, H, N, D] (summed over batch and tokens)."""
    x = x.double()
    return (torch.einsum("bhnd,hde->bhne", x, gram) * x).sum(dim=(0, 2, 3))


def _projected_norm(x: torch.Tensor, gram: torch.Tensor) -> torch.Tensor:
    """float64 []: ||x W^T|| of the heads' outputs x [B, H, N, D] concatenated, given gram = W^T W [H * D, H * D]."""
    flat = x.double().transpose(1, 2).flatten(2)  # [B, N, H * D]
    return ((flat @ gram) * flat).sum().sqrt()


def _row_weights(q_len: int, block_q: int, device) -> torch.Tensor:
    """float64 [QB]: the share of the q_len query rows in each query block (the last one may be short)."""
    rows = torch.full((-(-q_len // block_q),), float(block_q), dtype=torch.float64, device=device)
    rows[-1] = q_len - (rows.numel() - 1) * block_q
    return rows / q_len


class _Measurement:
    """What a calibrated transformer's dense layers hand their video attention to
    (:func:`sparsevid.integration.set_attention_measure`): each call goes, with the layer's output projection, to
    the :class:`HeadMeter` of the noise range its timestep falls in (one meter per range of ``splits``; sigma =
    timestep / ``num_train_timesteps``). ``tile``: the token order of the masks."""

    def __init__(self, meters: Sequence[HeadMeter], splits: Sequence[float], num_train_timesteps: float,
                 projections: Sequence[torch.Tensor | None], tile):
        self.meters, self.splits, self.num_train_timesteps = list(meters), tuple(splits), num_train_timesteps
        self.projections, self.tile = list(projections), tile
        self.by_timestep = bool(self.splits)  # only then does a call need its forward's timestep

    def __call__(self, layer: int, q, k, v, scale, text, timestep: float | None) -> None:
        meter = self.meters[0]
        if self.by_timestep:
            if timestep is None:
                raise ValueError("a calibration by noise range needs forwards with a timestep; this forward had none")
            meter = self.meters[range_index(self.splits, timestep / self.num_train_timesteps)]
        meter.add(layer, q, k, v, scale=scale, projection=self.projections[layer], text=text)


def _output_projections(transformer: torch.nn.Module, adapter) -> list[torch.Tensor | None]:
    """Per self-attention layer, the weight [C, H * D] that carries its output into the residual stream: its own output
    projection (the last of the adapter's ``projections``, e.g. ``to_out.0``), or, in a single-stream block that
    concatenates the attention output with its MLP's before one ``proj_out`` (HunyuanVideo, FramePack, Motif-Video),
    that projection's first H * D columns; None where neither exists."""
    parents = {id(child): module for module in transformer.modules() for child in module.children()}
    weights = []
    for attention in adapter.self_attentions(transformer):
        weights.append(_linear_weight(attention, adapter.projections[-1]))
        if weights[-1] is None:
            query = _linear_weight(attention, adapter.projections[0])
            shared = _linear_weight(parents.get(id(attention)), "proj_out")
            if query is not None and shared is not None and shared.shape[1] > query.shape[0]:
                weights[-1] = shared[:, :query.shape[0]]
    return weights


def _linear_weight(module: torch.nn.Module | None, name: str) -> torch.Tensor | None:
    """The weight of the linear layer ``name`` inside ``module``, None where there is none."""
    try:
        linear = module.get_submodule(name) if module is not None else None
    except AttributeError:
        return None
    return linear.weight if isinstance(linear, torch.nn.Linear) else None


def calibrate_heads(transformer: torch.nn.Module, forwards: Iterable[Callable[[], object]], candidates=None,
                    block_q: int = DEFAULT_BLOCK_Q, block_k: int = DEFAULT_BLOCK_K, tile="auto",
                    backend: str = "auto", inputs: dict | None = None, noise_splits: Sequence[float] = (),
                    num_train_timesteps: float = 1000.0):
    """Measure every head of ``transformer`` (a dense diffusers video transformer of a supported family) under
    each candidate setting while ``forwards`` run: each item is called and runs some dense forwards of it (a
    forward on cached latents, a whole sampling, ...). Returns a
    :class:`~sparsevid.plan.calibration.Calibration` without a choice yet (``.choose(...)``); with
    ``noise_splits`` (noise levels in (0, 1), ascending) a
    :class:`~sparsevid.plan.noise_ranges.NoiseRangeCalibration`: each call measured in the range of its forward's
    noise level sigma = timestep / ``num_train_timesteps`` (the timestep in the flow convention: 1000 t at noise
    level t for diffusers' flow-matching schedulers); a range no call fell in merges into its neighbours (a plain
    Calibration when the calls reached one range only).

    The measurement runs inside the sparse processors with every layer dense (installed for the call and removed
    after it), so it sees each layer's video tokens as the sparse layers will (the families' token layouts, text
    padding, token order); the video rows of a joint text-video attention are measured with their dense text keys.

    candidates: default ``default_candidates()``; block_q, block_k, tile: the tiles and token order of the
    masks (as the configuration will use them); backend: the attention backend; inputs: a description of what
    ran, kept in the file.
    """
    return calibrate_transformers({"transformer": transformer}, forwards, candidates, block_q, block_k, tile,
                                  backend, inputs, noise_splits, num_train_timesteps)["transformer"]


def calibrate_transformers(transformers: dict[str, torch.nn.Module], forwards: Iterable[Callable[[], object]],
                           candidates=None, block_q: int = DEFAULT_BLOCK_Q, block_k: int = DEFAULT_BLOCK_K,
                           tile="auto", backend: str = "auto", inputs: dict | None = None,
                           noise_splits: Sequence[float] = (), num_train_timesteps: float = 1000.0) -> dict:
    """:func:`calibrate_heads` of several transformers measured over the same ``forwards`` (a pipeline's, e.g.
    Wan2.2's two experts ``transformer`` and ``transformer_2``, each sampling step running one of them):
    {name: Calibration (NoiseRangeCalibration with ``noise_splits``)}. ValueError naming a transformer whose
    layers the forwards never ran (in a noise range: naming the range)."""
    from ..integration import adapter_for, apply_sparse_attention, is_sparse, remove_sparse_attention
    from ..integration import set_attention_measure
    from ..integration.adapters import attention_heads
    from ..plan import SparseConfig
    from ..plan.calibration import Calibration, default_candidates

    candidates = default_candidates() if candidates is None else candidates
    splits = check_splits(noise_splits) if len(noise_splits) else ()
    num_train_timesteps = check_timestep_scale(num_train_timesteps)
    measured = {}
    for name, transformer in transformers.items():
        if is_sparse(transformer):
            raise ValueError(f"{name} must run dense attention: remove its sparse attention before calibrating")
        adapter = adapter_for(transformer)
        attentions = adapter.self_attentions(transformer)
        all_dense = SparseConfig(block_q=block_q, block_k=block_k, tile=tile, backend=backend,
                                 dense_layers=tuple(range(len(attentions))))  # checks them, naming the bad one
        meters = [HeadMeter([attention_heads(a) for a in attentions], candidates, block_q, block_k, backend)
                  for _ in range(len(splits) + 1)]
        measured[name] = (adapter, meters, all_dense, _Measurement(
            meters, splits, num_train_timesteps, _output_projections(transformer, adapter), tile))
    try:
        for name, (_, _, all_dense, measurement) in measured.items():
            apply_sparse_attention(transformers[name], all_dense)
            set_attention_measure(transformers[name], measurement)
        with torch.no_grad():
            for forward in forwards:
                forward()
    finally:
        for transformer in transformers.values():
            if is_sparse(transformer):
                remove_sparse_attention(transformer)
    settings = {"block_q": block_q, "block_k": block_k, "tile": list(tile) if isinstance(tile, tuple) else tile}
    calibrations = {}
    for name, (adapter, meters, _, _) in measured.items():
        model = {"family": adapter.name, "class_name": type(transformers[name]).__name__, "heads": meters[0].heads}
        kept, kept_splits = _reached_ranges(meters, splits)
        ranges = []
        for r, (low, high) in zip(kept, range_bounds(kept_splits)):
            try:
                means = meters[r].means()
            except ValueError as error:
                where = f" at noise levels {range_label(low, high)}" if kept_splits else ""
                raise ValueError(f"{name}{where}: {error}") from None
            ranges.append(Calibration(model, settings, meters[r].candidates, **means,
                                      inputs={**(inputs or {}), "calls_per_layer": list(meters[r].calls)}))
        calibrations[name] = (NoiseRangeCalibration(kept_splits, ranges, num_train_timesteps) if kept_splits
                              else ranges[0])
    return calibrations


def _reached_ranges(meters: Sequence[HeadMeter], splits: tuple[float, ...]) -> tuple[list[int], tuple[float, ...]]:
    """(the noise ranges some forward reached, the splits between them): a range no call fell in, in any layer (a
    split below every step of a short sampling; the levels one expert of a two-expert pipeline does not serve), is
    merged into its neighbours. The first alone when none was (the measurement then names the layers it missed)."""
    kept = [r for r, meter in enumerate(meters) if any(meter.calls)] or [0]
    return kept, tuple(splits[r - 1] for r in kept[1:])


def _panels(calibration) -> list[tuple[str, object]]:
    """(title, Calibration) of each part of a calibration: itself, or each noise range of a NoiseRangeCalibration."""
    if len(calibration.parts) == 1:
        return [("", calibration)]
    return [(f"noise levels {range_label(low, high)} ({weight:.0%} of the calls)", part)
            for part, (low, high), weight in zip(calibration.ranges, calibration.bounds, calibration.weights())]


def _row_label(title: str) -> str:
    """A panel title as a row label: "noise levels [0, 0.5)\n(40% of the calls)\nlayer"."""
    return title.replace(" (", "\n(") + "\nlayer" if title else "layer"


def calibration_table(calibration, max_heads: int = 8) -> str:
    """A text table of a calibration's choice: per layer its mean sparsity and error, then each head's setting with
    its sparsity and error (layers of more than ``max_heads`` heads: how many heads took each kind of setting and
    their sparsity range); the overall means last. A calibration by noise range: one table per range, then the
    call-weighted means."""
    panels = _panels(calibration)
    if len(panels) > 1:
        summary = calibration.summary()
        tables = [f"{title}:\n{_choice_table(part, max_heads)}" for title, part in panels]
        return "\n\n".join(tables) + (f"\nall ranges: mean sparsity {summary['mean_sparsity']:.1%}, mean error "
                                        f"{summary['mean_error']:.4f}, mean exact attention mass kept "
                                        f"{summary['mean_recall']:.3f}")
    return _choice_table(calibration, max_heads)


def _choice_table(calibration, max_heads: int) -> str:
    summary = calibration.summary()
    lines = [f"{'layer':>5}  {'sparsity':>8}  {'error':>7}  heads (setting: sparsity / output error)"]
    for layer, (labels, sparsity, error) in enumerate(zip(summary["labels"], summary["sparsity"], summary["error"])):
        if len(labels) <= max_heads:
            heads = ", ".join(f"{label}: {s:.0%}/{e:.3f}" for label, s, e in zip(labels, sparsity, error))
        else:
            kinds = collections.Counter(label.split(" ")[0] for label in labels)
            heads = (", ".join(f"{count} {kind}" for kind, count in sorted(kinds.items()))
                     + f"; sparsity {min(sparsity):.0%}..{max(sparsity):.0%}")
        lines.append(f"{layer:>5}  {sum(sparsity) / len(sparsity):>8.1%}  {sum(error) / len(error):>7.4f}  {heads}")
    lines.append(f"{'all':>5}  {summary['mean_sparsity']:>8.1%}  {summary['mean_error']:>7.4f}  "
                 f"(mean exact attention mass kept {summary['mean_recall']:.3f})")
    return "\n".join(lines)


def plot_calibration(calibration, path: str | Path) -> Path:
    """Heat maps (layer x head) of the chosen sparsity and output error of a calibration (one row of them per noise
    range of a NoiseRangeCalibration), as a PNG at ``path``."""
    from ..training.plots import pyplot, save_figure

    panels = _panels(calibration)
    heads = max(calibration.model["heads"])
    layers = calibration.num_layers
    plt = pyplot()
    width = 4 + 0.5 * heads + (2 if len(panels) > 1 else 0)  # room for the range labels
    fig, axes = plt.subplots(len(panels), 2, squeeze=False, figsize=(width, (1.5 + 0.3 * layers) * len(panels)))
    for row_axes, (title, part) in zip(axes, panels):
        summary = part.summary()
        for ax, name, cmap in zip(row_axes, ("sparsity", "error"), ("viridis", "magma")):
            table = torch.full((layers, heads), float("nan"))
            for layer, row in enumerate(summary[name]):
                table[layer, :len(row)] = torch.tensor(row)
            image = ax.imshow(table.numpy(), aspect="auto", cmap=cmap, interpolation="nearest")
            ax.set(xlabel="head", ylabel="layer", xticks=range(heads), yticks=range(layers),
                   title=f"{name} (mean {summary[f'mean_{name}']:.3g})")
            fig.colorbar(image, ax=ax)
        row_axes[0].set_ylabel(_row_label(title))
    return save_figure(fig, path)
