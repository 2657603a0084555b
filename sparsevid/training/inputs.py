"""The forward arguments of one training call of a diffusers video transformer: noisy latents and a batch's
conditioning laid out as the family's pipeline calls its transformer (the facts in its ``ModelAdapter``).

A batch's ``extra`` tensors are forward arguments by name, except ``condition_latents`` [B, C', T, H, W]: the
conditioning channels (reference or image latents and their mask) that the pipeline concatenates after the noisy
latents, for a transformer whose input is wider than what it predicts (``ModelAdapter.channels``).
"""
from __future__ import annotations

import torch

from ..integration.adapters import FLOW_TIMESTEPS, ModelAdapter
from .latents import LatentBatch

CONDITION = "condition_latents"


def forward_inputs(adapter: ModelAdapter, module: torch.nn.Module, x_t: torch.Tensor, t: torch.Tensor,
                   batch: LatentBatch) -> dict:
    """The keyword arguments of ``module``'s forward (``return_dict`` aside) at noisy latents ``x_t`` [B, C, T, H, W]
    and noise levels ``t`` [B] in [0, 1], conditioned on ``batch``. ValueError naming what the data lack."""
    extra = dict(batch.extra)
    hidden = _with_condition(adapter, module, x_t, extra.pop(CONDITION, None))
    inputs = {**extra, **_text_inputs(adapter, batch), **adapter.latent_inputs(hidden, module.config)}
    for name in (*adapter.call_inputs, *adapter.call_tensors):
        if name in inputs:
            row = _per_call(name, inputs[name])
            inputs[name] = tuple(row.tolist()) if name in adapter.call_inputs else row
    missing = [name for name in adapter.required_inputs if name not in inputs]
    if missing:
        stored = ", ".join("text_mask" if name == "encoder_attention_mask" else f"extra.{name}" for name in missing)
        raise ValueError(f"{type(module).__name__} cannot be called without {', '.join(missing)}: the training data "
                         f"must carry them per sample ({stored}), as its pipeline passes them")
    return {**inputs, "timestep": adapter.flow_timestep(t * FLOW_TIMESTEPS)}


def _with_condition(adapter: ModelAdapter, module: torch.nn.Module, x_t: torch.Tensor,
                    condition: torch.Tensor | None) -> torch.Tensor:
    """``x_t`` followed on the channel dim by the conditioning channels the transformer takes: ``condition`` or, for
    a family whose text-to-video pipeline passes zeros there, zeros when it is None."""
    name, channels = type(module).__name__, adapter.channels(module.config)[1]
    if channels == 0:
        if condition is not None:
            raise ValueError(f"the data carry extra.{CONDITION}, but {name} takes no conditioning channels")
        return x_t
    if condition is None:
        if not adapter.zero_condition:
            raise ValueError(f"{name} takes {channels} conditioning channels after the latents (reference or image "
                             f"latents and their mask, as its pipeline concatenates them): the training data must "
                             f"carry them per sample as extra.{CONDITION} [{channels}, T, H, W]")
        condition = x_t.new_zeros(x_t.shape[0], channels, *x_t.shape[2:])
    expected = (x_t.shape[0], channels, *x_t.shape[2:])
    if tuple(condition.shape) != expected:
        raise ValueError(f"extra.{CONDITION} has shape {tuple(condition.shape)}, {name} takes {expected} with these "
                         f"latents")
    return torch.cat([x_t, condition.to(x_t.dtype)], dim=1)


def _text_inputs(adapter: ModelAdapter, batch: LatentBatch) -> dict:
    """The text states and, as the family takes them, their mask or positions."""
    text, mask = batch.text, batch.text_mask
    if adapter.text_mask:
        if mask is None and adapter.needs_text_mask:  # every text token valid
            mask = torch.ones(text.shape[:2], dtype=torch.bool, device=text.device)
        return {"encoder_hidden_states": text} if mask is None else {"encoder_hidden_states": text,
                                                                     "encoder_attention_mask": mask}
    if adapter.text_positions is None:
        return {"encoder_hidden_states": text}
    if mask is not None:
        lengths = mask.bool().sum(1)
        if not torch.equal(mask.bool(), torch.arange(mask.shape[1], device=mask.device) < lengths[:, None]):
            raise ValueError("text_mask must mark each prompt's tokens first (padding after them): the transformer "
                             "takes no mask, and the text is cut to the batch's longest prompt")
        text = text[:, :int(lengths.max())]
    return {"encoder_hidden_states": text, adapter.text_positions: torch.arange(text.shape[1], device=text.device)}


def _per_call(name: str, values: torch.Tensor) -> torch.Tensor:
    """The one row of a batch's per-sample rows ``values`` [B, ...] (ValueError if the rows differ)."""
    if not torch.equal(values, values[:1].expand_as(values)):
        raise ValueError(f"extra[{name!r}] differs between the batch's samples ({values.tolist()}), but the "
                         f"transformer takes one value per call: batch only samples that share it (e.g. cache clips "
                         f"at one --fps)")
    return values[0]
