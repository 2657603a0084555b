"""The one-line switch: ``apply_sparse_attention`` / ``remove_sparse_attention`` and the runtime helpers."""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..schedules import SparseConfig
from .adapters import ModelAdapter, adapter_for, forward_argument
from .processors import SparseAttnProcessor
from .step_context import StepContext

_STATE_ATTR = "_sparsevid_state"


@dataclass
class SparseState:
    """What ``apply_sparse_attention`` installed on a transformer (kept to undo it exactly)."""

    config: SparseConfig
    context: StepContext
    attentions: list
    originals: list
    hook: torch.utils.hooks.RemovableHandle


def _begin_forward(adapter: ModelAdapter, context: StepContext, module, args, kwargs):
    """Forward pre-hook: advance the denoising step from ``timestep`` and record the latent grid."""
    hidden_states = forward_argument(module, "hidden_states", args, kwargs)
    context.begin_forward(forward_argument(module, "timestep", args, kwargs),
                          adapter.grid(hidden_states, module.config))


def _check_layers(config: SparseConfig, num_layers: int) -> None:
    for name, layers in (("dense_layers", config.dense_layers), ("layer_overrides", config.layer_overrides)):
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


def apply_sparse_attention(transformer: torch.nn.Module, config: SparseConfig | None = None, *,
                           collect_stats: bool = False) -> torch.nn.Module:
    """Make every video self-attention of a diffusers video transformer block-sparse, in place.

    Args:
        transformer: ``WanTransformer3DModel``, ``HunyuanVideoTransformer3DModel`` or
            ``CogVideoXTransformer3DModel`` (e.g. ``pipe.transformer``). Cross-attention and text-only
            attention are left alone. Applying again replaces the previous configuration.
        config: a :class:`SparseConfig` (default ``SparseConfig()``).
        collect_stats: record per-layer sparsity and timings for :func:`attention_stats`.
    Returns the same transformer.
    """
    config = SparseConfig() if config is None else config
    if not isinstance(config, SparseConfig):
        raise TypeError(f"config must be a sparsevid.SparseConfig, got {type(config).__name__}")
    if not isinstance(collect_stats, bool):
        raise TypeError(f"collect_stats must be a bool, got {collect_stats!r}")
    adapter = adapter_for(transformer)
    if getattr(transformer, _STATE_ATTR, None) is not None:
        remove_sparse_attention(transformer)
    attentions = adapter.self_attentions(transformer)
    _check_layers(config, len(attentions))
    context = StepContext(collect_stats=collect_stats)
    originals = [attn.processor for attn in attentions]
    processors = [SparseAttnProcessor(proc, i, config, context, adapter) for i, proc in enumerate(originals)]
    for attn, processor in zip(attentions, processors):
        attn.set_processor(processor)
    hook = transformer.register_forward_pre_hook(functools.partial(_begin_forward, adapter, context),
                                                 with_kwargs=True)
    setattr(transformer, _STATE_ATTR, SparseState(config, context, attentions, originals, hook))
    return transformer


def remove_sparse_attention(transformer: torch.nn.Module) -> torch.nn.Module:
    """Put back the exact processor objects ``apply_sparse_attention`` replaced and remove its hook."""
    state = _state(transformer)
    for attn, original in zip(state.attentions, state.originals):
        attn.set_processor(original)
    state.hook.remove()
    delattr(transformer, _STATE_ATTR)
    return transformer


def is_sparse(transformer: torch.nn.Module) -> bool:
    """Whether ``apply_sparse_attention`` is in effect on ``transformer``."""
    return getattr(transformer, _STATE_ATTR, None) is not None


def attention_stats(transformer: torch.nn.Module) -> list[dict]:
    """Per self-attention call of the last forward, a dict of: layer, step, dense, sparsity (video-to-video,
    area-weighted), video_tokens, text_tokens and the times in ms of the attention call (``attention_ms``,
    the whole stand-in for SDPA) and its parts: ``reorder_ms`` (tiling q/k/v), ``predict_ms`` (mask
    prediction), ``kernel_ms`` (block-sparse kernels, plus text keys and merge for joint attention) and
    ``restore_ms`` (undoing the tiling, plus dense text rows). Dense calls have attention_ms only.

    Needs ``collect_stats=True`` (see :func:`apply_sparse_attention` / :func:`set_collect_stats`).
    Reading the numbers synchronises with the device.
    """
    state = _state(transformer)
    if not state.context.collect_stats:
        raise ValueError("stats are off; pass collect_stats=True to apply_sparse_attention or call "
                         "sparsevid.set_collect_stats(transformer, True)")
    return [record.as_dict() for record in state.context.records]


def set_collect_stats(transformer: torch.nn.Module, enabled: bool) -> None:
    """Turn per-layer stats collection on or off."""
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, got {enabled!r}")
    _state(transformer).context.collect_stats = enabled


def reset_denoising_step(transformer: torch.nn.Module) -> None:
    """Start counting denoising steps afresh: the next forward is step 0."""
    _state(transformer).context.reset()


def set_denoising_step(transformer: torch.nn.Module, step: int | None) -> None:
    """Pin the denoising step seen by the schedule (None resumes counting from the timesteps)."""
    _state(transformer).context.set_step(step)


def denoising_step(transformer: torch.nn.Module) -> int | None:
    """The denoising step of the last forward."""
    return _state(transformer).context.step
