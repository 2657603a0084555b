"""The one-line switch: ``apply_sparse_attention`` / ``remove_sparse_attention`` and the runtime helpers."""
from __future__ import annotations

import contextlib
import functools
import warnings
from dataclasses import dataclass

import torch

from ..plan import LayerRuntime, SparseConfig
from .adapters import ModelAdapter, adapter_for, attention_heads, forward_argument
from .context_parallel import check_parallel_config
from .processors import SparseAttnProcessor
from .step_context import StepContext, fresh_counter
from .token_order import forward_tile, install_reordering, tile_order

_STATE_ATTR = "_sparsevid_state"
_COUNTER_BUFFER = "_sparsevid_step_counter"


@dataclass
class SparseState:
    """What ``apply_sparse_attention`` installed on a transformer (kept to undo it exactly).

    runtimes: one LayerRuntime per self-attention (the mask decisions); fixed_tile: the forward's token order
    when the configuration does not vary with the step (decided once, at apply time).
    """

    config: SparseConfig
    context: StepContext
    attentions: list
    originals: list
    processors: list
    runtimes: list[LayerRuntime]
    hooks: list[torch.utils.hooks.RemovableHandle]
    varies_with_step: bool
    fixed_tile: tuple[int, int, int] | None


@torch.compiler.disable
def _begin_step(state: SparseState) -> tuple[int, int, int] | None:
    """Host-side bookkeeping of a forward whose plans vary with the step: read where the denoising is (one
    device read, none after ``reset_denoising_step`` unless the plans follow the timestep), hand it to every
    layer's runtime, and return the tile most sparse layers of this step use."""
    position = state.context.position(with_timestep=state.config.follows_timestep)
    return forward_tile([runtime.begin(position) for runtime in state.runtimes])


def _begin_forward(adapter: ModelAdapter, state: SparseState, module, args, kwargs):
    """Forward pre-hook: advance the denoising step from ``timestep`` (on the device; in the flow convention, where the
    timestep falls over the denoising: ``ModelAdapter.flow_timestep``), record the latent grid,
    start the layers' runtimes at this step (only when the plans vary with the step) and choose the video token
    order of this forward (the tile most sparse layers of this step use; raster if none). Refuses a context-parallel
    model that ``enable_parallelism`` made so without telling the processors (those that take no parallel config)."""
    check_parallel_config(getattr(module, "_parallel_config", None), adapter)
    context = state.context
    hidden_states = forward_argument(module, "hidden_states", args, kwargs)
    grid = adapter.call_grid(module, args, kwargs)
    context.counter = getattr(module, _COUNTER_BUFFER)  # the buffer follows transformer.to(device)
    context.begin_forward(adapter.flow_timestep(forward_argument(module, "timestep", args, kwargs)), grid)
    tile = _begin_step(state) if state.varies_with_step else state.fixed_tile
    if grid is None or not adapter.reorders_forward(module.config):
        tile = None
    order = None if tile is None else tile_order(grid, tile, hidden_states.device)
    context.begin_order(tile, order, hidden_states.device)


def _set_processor(attn: torch.nn.Module, processor) -> None:
    """Give ``attn`` ``processor`` (diffusers' ``set_processor``; Mochi's attention module has none, only the
    attribute)."""
    if hasattr(attn, "set_processor"):
        attn.set_processor(processor)
    else:
        attn.processor = processor


def _check_layers(config: SparseConfig, num_layers: int) -> None:
    named = [("dense_layers", config.dense_layers), ("layer_overrides", config.layer_overrides)]
    named += [(f"noise_overrides[{i}].layer_overrides", entry["layer_overrides"])
              for i, entry in enumerate(config.noise_overrides)]
    for name, layers in named:
        bad = sorted(i for i in layers if i >= num_layers)
        if bad:
            raise ValueError(f"config.{name} names layers {bad}, but the transformer has {num_layers} "
                             f"self-attention layers (0..{num_layers - 1})")


def _state(transformer) -> SparseState:
    state = getattr(transformer, _STATE_ATTR, None)
    if state is None:
        raise ValueError(f"sparse attention is not applied to this {type(transformer).__name__}; "
                         f"call sparsevid.apply_sparse_attention first")
    return state


def _stats_context(transformer) -> StepContext:
    context = _state(transformer).context
    if not context.collect_stats:
        raise ValueError("stats are off; pass collect_stats=True to apply_sparse_attention or call "
                         "sparsevid.set_collect_stats(transformer, True)")
    return context


def _device_of(transformer: torch.nn.Module) -> torch.device:
    parameter = next(transformer.parameters(), None)
    return torch.device("cpu") if parameter is None else parameter.device


def pipeline_transformers(pipe) -> dict[str, torch.nn.Module]:
    """{component name: transformer} of the video transformers of a diffusers pipeline (``transformer``, and
    ``transformer_2`` for Wan2.2's two-expert pipelines); ValueError when it has none."""
    components = getattr(pipe, "components", None)
    if not isinstance(components, dict):
        raise TypeError(f"expected a diffusers video transformer or a pipeline holding one, got {type(pipe).__name__}")
    found = {name: module for name, module in components.items()
             if name.startswith("transformer") and isinstance(module, torch.nn.Module)}
    if not found:
        raise ValueError(f"the {type(pipe).__name__} has no transformer component")
    return found


def apply_sparse_attention(transformer, config: SparseConfig | dict | None = None, *, collect_stats: bool = False):
    """Make every video self-attention of a diffusers video transformer block-sparse, in place.

    Args:
        transformer: a diffusers video transformer of a supported family (``sparsevid.integration.adapters``:
            Wan, HunyuanVideo, CogVideoX, LTX-Video and more, docs/integration.md; e.g. ``pipe.transformer``), or a
            pipeline: then each of its transformers (:func:`pipeline_transformers`). Cross-attention and
            text-only attention are left alone. Applying again replaces the previous configuration.
        config: a :class:`SparseConfig` (default ``SparseConfig()``); for a pipeline also {component name:
            SparseConfig} (each named transformer gets its own; those not named stay dense).
        collect_stats: record per-layer sparsity and timings for :func:`attention_stats`.
    Returns the same transformer (or pipeline). It may then be compiled (``torch.compile`` or diffusers'
    ``compile_repeated_blocks``); see docs/integration.md.
    """
    if not isinstance(transformer, torch.nn.Module):
        transformers = pipeline_transformers(transformer)
        configs = config if isinstance(config, dict) else {name: config for name in transformers}
        unknown = sorted(set(configs) - set(transformers))
        if unknown:
            raise ValueError(f"config names {unknown}, but the pipeline's transformers are {sorted(transformers)}")
        for name, per_transformer in configs.items():
            apply_sparse_attention(transformers[name], per_transformer, collect_stats=collect_stats)
        return transformer
    config = SparseConfig() if config is None else config
    if not isinstance(config, SparseConfig):
        raise TypeError(f"config must be a sparsevid.SparseConfig, got {type(config).__name__}")
    if not isinstance(collect_stats, bool):
        raise TypeError(f"collect_stats must be a bool, got {collect_stats!r}")
    adapter = adapter_for(transformer)
    check_parallel_config(getattr(transformer, "_parallel_config", None), adapter)  # enable_parallelism records it
    if getattr(transformer, _STATE_ATTR, None) is not None:
        remove_sparse_attention(transformer)
    attentions = adapter.self_attentions(transformer)
    config.check_model(adapter.name, [attention_heads(attn) for attn in attentions])
    _check_layers(config, len(attentions))
    context = StepContext(collect_stats=collect_stats)
    transformer.register_buffer(_COUNTER_BUFFER, fresh_counter(_device_of(transformer)), persistent=False)
    originals = [attn.processor for attn in attentions]
    runtimes = [LayerRuntime(i, config) for i in range(len(attentions))]
    processors = [SparseAttnProcessor(proc, runtime, context, adapter) for proc, runtime in zip(originals, runtimes)]
    for attn, processor in zip(attentions, processors):
        _set_processor(attn, processor)
    state = SparseState(config, context, attentions, originals, processors, runtimes, [], config.varies_with_step,
                        forward_tile([runtime.plan for runtime in runtimes]))
    state.hooks.append(transformer.register_forward_pre_hook(functools.partial(_begin_forward, adapter, state),
                                                             with_kwargs=True))
    state.hooks += install_reordering(transformer, adapter.token_sites, adapter.output_module, context)
    setattr(transformer, _STATE_ATTR, state)
    return transformer


def remove_sparse_attention(transformer):
    """Undo :func:`apply_sparse_attention` (on a transformer, or on each sparse transformer of a pipeline): remove
    its hooks and put the original processors back in the layers that still hold the sparse processors it
    installed. A layer whose processor was replaced since (e.g. by
    ``set_attn_processor``) keeps that processor; a warning names such layers. Returns the same transformer.
    """
    if not isinstance(transformer, torch.nn.Module):
        for module in pipeline_transformers(transformer).values():
            if getattr(module, _STATE_ATTR, None) is not None:
                remove_sparse_attention(module)
        return transformer
    state = _state(transformer)
    restored, kept = 0, []
    for layer, (attn, original, processor) in enumerate(zip(state.attentions, state.originals, state.processors)):
        if attn.processor is processor:
            _set_processor(attn, original)
            restored += 1
        else:
            kept.append(layer)
    if kept:
        warnings.warn(f"remove_sparse_attention: self-attention layers {kept} had their processor replaced after "
                      f"apply_sparse_attention; they keep it (restored {restored} of {len(state.attentions)})",
                      stacklevel=2)
    for hook in state.hooks:
        hook.remove()
    transformer._buffers.pop(_COUNTER_BUFFER, None)
    delattr(transformer, _STATE_ATTR)
    return transformer


def is_sparse(transformer) -> bool:
    """Whether ``apply_sparse_attention`` is in effect on ``transformer`` (for a pipeline: on any of its
    transformers) and at least one of its self-attentions still runs a sparsevid processor (not replaced since by
    another processor)."""
    if not isinstance(transformer, torch.nn.Module):
        return any(is_sparse(module) for module in pipeline_transformers(transformer).values())
    state = getattr(transformer, _STATE_ATTR, None)
    if state is None:
        return False
    return any(attn.processor is processor for attn, processor in zip(state.attentions, state.processors))


def attention_stats(transformer) -> list[dict] | dict[str, list[dict]]:
    """Per self-attention call of the last forward, a dict of: layer, step, dense, sparsity (video-to-video,
    area-weighted), video_tokens, text_tokens and the times in ms of the attention call (``attention_ms``,
    the whole stand-in for SDPA) and its parts: ``reorder_ms`` (selecting the video q/k/v, and tiling them
    when this layer's tile differs from the forward's token order), ``predict_ms`` (mask prediction),
    ``kernel_ms`` (block-sparse kernels, plus text keys and merge for joint attention) and ``restore_ms``
    (placing the output, undoing a per-layer tiling, plus dense text rows). Dense calls have attention_ms
    only. The once-per-forward token reordering is reported by :func:`forward_stats`.

    Needs ``collect_stats=True`` (see :func:`apply_sparse_attention` / :func:`set_collect_stats`).
    Reading the numbers synchronises with the device. For a pipeline: {component name: that list} of each of its
    sparse transformers.
    """
    if not isinstance(transformer, torch.nn.Module):
        return {name: attention_stats(module) for name, module in pipeline_transformers(transformer).items()
                if getattr(module, _STATE_ATTR, None) is not None}
    return [record.as_dict() for record in attention_records(transformer)]


def attention_records(transformer: torch.nn.Module) -> list:
    """The raw per-call records of the last forward, without reading the device (a new list each forward;
    ``record.as_dict()`` gives what :func:`attention_stats` reports). For collecting many forwards cheaply."""
    return _stats_context(transformer).records


def forward_stats(transformer: torch.nn.Module) -> dict:
    """Per-forward stats of the last forward: step, ``tile`` (the 3D tile its video tokens were ordered in,
    None for raster order) and the times in ms of putting the tokens in that order once (``reorder_ms``:
    patch embedding, RoPE tables, per-token inputs) and back (``restore_ms``: the output projection).

    Needs stats on (see :func:`attention_stats`); reading the numbers synchronises with the device.
    """
    record = _stats_context(transformer).forward_record
    if record is None:
        raise ValueError("no forward has run with stats on yet")
    return record.as_dict()


@contextlib.contextmanager
def dense_attention(transformer: torch.nn.Module):
    """Inside ``with``, every sparse self-attention of ``transformer`` runs dense (its original processor), e.g.
    for the dense teacher's pass of velocity distillation on the student's own weights; the sparse setting
    returns on exit. The denoising step is counted as usual."""
    context = _state(transformer).context
    before, context.dense = context.dense, True
    try:
        yield transformer
    finally:
        context.dense = before


def set_collect_stats(transformer: torch.nn.Module, enabled: bool) -> None:
    """Turn per-layer stats collection on or off."""
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, got {enabled!r}")
    _state(transformer).context.collect_stats = enabled


def set_attention_measure(transformer: torch.nn.Module, measure) -> None:
    """Make every dense layer of a sparse ``transformer`` hand its video attention to ``measure`` (a callable
    ``(layer, q, k, v, scale, text, timestep)`` with attributes ``tile`` and ``by_timestep``, whether it needs the
    forward's timestep (None otherwise, so that no call waits for the device): a per-head calibration's measurement,
    ``sparsevid.eval.calibrate``); None stops it."""
    if measure is not None and not callable(measure):
        raise TypeError(f"measure must be callable or None, got {type(measure).__name__}")
    _state(transformer).context.measure = measure


def reset_denoising_step(transformer: torch.nn.Module) -> None:
    """Start counting denoising steps afresh: the next forward is step 0."""
    _state(transformer).context.reset()


def set_denoising_step(transformer: torch.nn.Module, step: int | None) -> None:
    """Pin the denoising step seen by the schedule (None resumes counting from the timesteps)."""
    _state(transformer).context.set_step(step)


def denoising_step(transformer: torch.nn.Module) -> int | None:
    """The denoising step of the last forward."""
    return _state(transformer).context.step
