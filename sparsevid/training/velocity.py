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
from .inputs import forward_inputs
from .latents import LatentBatch
from .lora import adapters_off


def check_flow_family(transformer: torch.nn.Module) -> None:
    """TypeError unless ``transformer`` is a supported diffusers video transformer trained by flow matching that
    sparsevid's training path can call (``ModelAdapter.training_refused``)."""
    adapter = adapter_for(transformer)
    name = type(transformer).__name__
    if adapter.objective != "flow":
        raise TypeError(f"{name} was pre-trained with the {adapter.objective!r} objective; sparsevid's training and "
                        f"velocity yardsticks support flow-matching families (Wan, HunyuanVideo, LTX-Video, Mochi, ...)")
    if adapter.training_refused is not None:
        raise TypeError(f"{name} cannot be fine-tuned by sparsevid's training path: {adapter.training_refused}")


def predict_velocity(transformer: torch.nn.Module, x_t: torch.Tensor, t: torch.Tensor, batch: LatentBatch,
                     module: torch.nn.Module | None = None) -> torch.Tensor:
    """The velocity [B, C, T, H, W] that ``transformer`` predicts at noisy latents ``x_t`` [B, C, T, H, W] and
    noise levels ``t`` [B] in [0, 1], conditioned on ``batch``'s text (and extra inputs).

    ``module``: the diffusers transformer itself when ``transformer`` is a wrapper that forwards to it (e.g.
    ``DistributedDataParallel``); its family decides the call (:func:`.inputs.forward_inputs`: the latent layout,
    conditioning channels, per-call inputs) and reads the output back as latents."""
    module = transformer if module is None else module
    adapter = adapter_for(module)
    out = transformer(return_dict=False, **forward_inputs(adapter, module, x_t, t, batch))
    out = out if isinstance(out, torch.Tensor) else out[0]  # Kandinsky 5 returns the tensor itself
    velocity = adapter.latent_output(out, x_t.shape, module.config)
    return -velocity if adapter.inverted_time else velocity


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
