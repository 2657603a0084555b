"""Low-rank adapters (LoRA, through peft) on the video self-attention projections, the cheapest student: the base
weights stay frozen, so the dense teacher is the same transformer with its adapters switched off.

A trained adapter is written as plain tensors (``<projection>.lora_A`` [r, in], ``<projection>.lora_B`` [out, r])
and loaded by merging it into the base weights, W += (alpha / r) B A, so that inference runs without peft.
"""
from __future__ import annotations

import contextlib

import torch

from ..integration import adapter_for

ADAPTER_NAME = "sparsevid"


def lora_targets(transformer: torch.nn.Module) -> list[str]:
    """Module names of the linear projections of ``transformer``'s video self-attentions (q, k, v, out: the family's
    ``ModelAdapter.projections``)."""
    adapter = adapter_for(transformer)
    attentions = {id(m) for m in adapter.self_attentions(transformer)}
    targets = []
    for name, module in transformer.named_modules():
        if id(module) in attentions:
            children = dict(module.named_modules())  # single-stream blocks have no output projection (to_out None)
            targets += [f"{name}.{p}" for p in adapter.projections if isinstance(children.get(p), torch.nn.Linear)]
    return targets


def add_lora(transformer: torch.nn.Module, rank: int, alpha: float, seed: int = 0) -> list[str]:
    """Add a LoRA adapter of ``rank`` (scale ``alpha / rank``; B starts at zero, so the model is unchanged) to
    every video self-attention projection of ``transformer``; returns the adapted module names. The random A
    matrices are drawn from ``seed`` (the same on every rank of a job: sharded training does not broadcast them)."""
    from peft import LoraConfig, inject_adapter_in_model

    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"lora rank must be a positive int, got {rank!r}")
    targets = lora_targets(transformer)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)  # peft itself: diffusers' add_adapter is missing from some families (EasyAnimate)
        inject_adapter_in_model(LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets), transformer,
                                adapter_name=ADAPTER_NAME)
    return targets


def lora_tensors(state: dict[str, torch.Tensor], targets: list[str]) -> dict[str, torch.Tensor]:
    """{``<target>.lora_A``: [r, in], ``<target>.lora_B``: [out, r]} of the adapter :func:`add_lora` added, from
    the adapted transformer's ``state_dict`` ``state``."""
    return {f"{target}.lora_{part}": state[f"{target}.lora_{part}.{ADAPTER_NAME}.weight"]
            for target in targets for part in ("A", "B")}


@contextlib.contextmanager
def adapters_off(transformer: torch.nn.Module):
    """Inside ``with``, ``transformer``'s adapters are switched off (the base model)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [module for module in transformer.modules() if isinstance(module, BaseTunerLayer)]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield transformer
    finally:
        for layer in layers:
            layer.enable_adapters(True)


@torch.no_grad()
def merge_lora(transformer: torch.nn.Module, tensors: dict[str, torch.Tensor], rank: int, alpha: float) -> None:
    """Add each adapter's (alpha / rank) B A to its base linear layer of ``transformer`` (a plain model, no peft
    layers), in the layer's dtype."""
    for name in sorted(k[:-len(".lora_A")] for k in tensors if k.endswith(".lora_A")):
        weight = transformer.get_submodule(name).weight
        delta = tensors[f"{name}.lora_B"].float() @ tensors[f"{name}.lora_A"].float()
        if delta.shape != weight.shape:
            raise ValueError(f"the adapter of {name} makes a {tuple(delta.shape)} update, the layer is "
                             f"{tuple(weight.shape)}")
        weight.add_((alpha / rank) * delta.to(weight.device, weight.dtype))
