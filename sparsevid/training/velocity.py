"""Calling a diffusers video transformer of a flow-matching family on a noisy latent batch, and its dense
teacher on the same weights.

The velocity convention is the rectified flow of Wan and HunyuanVideo pre-training: x_t = (1 - t) x0 + t noise
at t in [0, 1], the transformer gets ``timestep = 1000 t`` and predicts ``noise - x0`` (a family with inverted time,
Mochi, gets ``1000 (1 - t)`` and predicts ``x0 - noise``: ``ModelAdapter.inverted_time``).
"""
from __future__ import annotations

import contextlib

import torch

from ..integration import adapter_for, dense_attention, is_sparse
from ..integration.adapters import FLOW_TIMESTEPS
from .latents import LatentBatch
from .lora import adapters_off


def check_flow_family(transformer: torch.nn.Module) -> None:
    """TypeError unless ``transformer`` is a supported diffusers video transformer trained by flow matching."""
    adapter = adapter_for(transformer)
    if adapter.objective != "flow":
        raise TypeError(f"{type(transformer).__name__} was pre-trained with the {adapter.objective!r} objective; "
                        f"sparsevid's training and velocity yardsticks support flow-matching families (Wan, "
                        f"HunyuanVideo, LTX-Video, Mochi)")


def predict_velocity(transformer: torch.nn.Module, x_t: torch.Tensor, t: torch.Tensor, batch: LatentBatch,
                     module: torch.nn.Module | None = None) -> torch.Tensor:
    """The velocity [B, C, T, H, W] that ``transformer`` predicts at noisy latents ``x_t`` [B, C, T, H, W] and
    noise levels ``t`` [B] in [0, 1], conditioned on ``batch``'s text (and extra inputs).

    ``module``: the diffusers transformer itself when ``transformer`` is a wrapper that forwards to it (e.g.
    ``DistributedDataParallel``); its family decides the latent layout (CogVideoX-style models take frames
    before channels, LTX-style ones patched tokens with the grid as arguments: ``ModelAdapter.latent_inputs``)."""
    module = transformer if module is None else module
    adapter = adapter_for(module)
    inputs = {"encoder_hidden_states": batch.text, **batch.extra, **adapter.latent_inputs(x_t, module.config)}
    for name in adapter.call_inputs:
        if name in inputs:
            inputs[name] = _per_call(name, inputs[name])
    if batch.text_mask is not None:
        inputs["encoder_attention_mask"] = batch.text_mask
    elif adapter.needs_text_mask:  # every text token valid
        inputs["encoder_attention_mask"] = torch.ones(batch.text.shape[:2], dtype=torch.bool, device=batch.text.device)
    out = transformer(timestep=adapter.flow_timestep(t * FLOW_TIMESTEPS), return_dict=False, **inputs)[0]
    velocity = adapter.latent_output(out, x_t.shape, module.config)
    return -velocity if adapter.inverted_time else velocity


def _per_call(name: str, values: torch.Tensor) -> tuple[float, ...]:
    """One tuple of numbers from a batch's per-sample rows ``values`` [B, K] (ValueError if the rows differ)."""
    if not torch.equal(values, values[:1].expand_as(values)):
        raise ValueError(f"extra[{name!r}] differs between the batch's samples ({values.tolist()}), but the "
                         f"transformer takes one value per call: batch only samples that share it (cache clips at one --fps)")
    return tuple(values[0].tolist())


class DenseTeacher:
    """The dense model that a sparse student is distilled from, without a second copy of the unchanged weights.

    It runs the student's own transformer with sparse attention off (:func:`sparsevid.integration.dense_attention`)
    and its trainable tensors swapped for frozen copies of their values when the teacher was made
    (``torch.func.functional_call``): fine-tuning only the self-attention costs one copy of the attention weights,
    fine-tuning every weight one copy of them all.

    A student fine-tuned through adapters (``adapters=True``, LoRA) keeps its base weights: the teacher is the
    transformer with its adapters switched off, and copies nothing.

    Args:
        transformer: the (dense, pretrained) diffusers transformer, before fine-tuning changes it.
        trainable_names: ``named_parameters`` names of the tensors fine-tuning will change.
        adapters: the student trains adapters only; the teacher runs with them off.
    """

    def __init__(self, transformer: torch.nn.Module, trainable_names: list[str], adapters: bool = False):
        parameters = dict(transformer.named_parameters())
        unknown = [name for name in trainable_names if name not in parameters]
        if unknown:
            raise ValueError(f"trainable_names are not parameters of the transformer: {unknown[:3]}")
        self.transformer, self.adapters = transformer, adapters
        self.frozen = {name: parameters[name].detach().clone() for name in trainable_names}

    @torch.no_grad()
    def __call__(self, x_t: torch.Tensor, t: torch.Tensor, batch: LatentBatch) -> torch.Tensor:
        """The teacher's velocity, as :func:`predict_velocity` (no gradient)."""
        def frozen(**inputs):
            return torch.func.functional_call(self.transformer, self.frozen, (), inputs, strict=False)

        with contextlib.ExitStack() as stack:
            if is_sparse(self.transformer):
                stack.enter_context(dense_attention(self.transformer))
            if self.adapters:
                stack.enter_context(adapters_off(self.transformer))
            return predict_velocity(frozen, x_t, t, batch, module=self.transformer)
