"""What the integration needs to know about each supported diffusers video transformer.

An adapter names the transformer's video self-attention modules (in layer order), reads the latent
token grid from the forward inputs, and says where text tokens sit in a joint attention sequence.
Everything else (projections, norms, RoPE, the attention call itself) stays diffusers' own code.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class ModelAdapter:
    """Model-family facts.

    Attributes:
        name: family name used in messages.
        class_name: the diffusers transformer class it handles.
        block_attrs: ((ModuleList attribute, attention attribute), ...) of the self-attentions, in order.
        frames_dim: dim of ``hidden_states`` (the 5D latent input) that holds frames; H, W are the last two.
        text_first: in joint attention, text tokens precede the video tokens (else they follow).
    """

    name: str
    class_name: str
    block_attrs: tuple[tuple[str, str], ...]
    frames_dim: int
    text_first: bool
    patch_sizes: Callable[[object], tuple[int, int, int]]

    def self_attentions(self, transformer: torch.nn.Module) -> list[torch.nn.Module]:
        """The video self-attention modules of ``transformer``, in layer order."""
        found = []
        for blocks_attr, attn_attr in self.block_attrs:
            for block in getattr(transformer, blocks_attr):
                found.append(getattr(block, attn_attr))
        return found

    def grid(self, hidden_states: torch.Tensor, config) -> tuple[int, int, int] | None:
        """(T, H, W) latent tokens after patching, from the 5D ``hidden_states`` input (None if not 5D)."""
        if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != 5:
            return None
        p_t, p_h, p_w = self.patch_sizes(config)
        frames = hidden_states.shape[self.frames_dim]
        return frames // p_t, hidden_states.shape[-2] // p_h, hidden_states.shape[-1] // p_w


def _wan_patch(config) -> tuple[int, int, int]:
    p_t, p_h, p_w = config.patch_size
    return int(p_t), int(p_h), int(p_w)


def _square_patch(config) -> tuple[int, int, int]:
    p_t = getattr(config, "patch_size_t", None) or 1
    return int(p_t), int(config.patch_size), int(config.patch_size)


ADAPTERS = (
    ModelAdapter("wan", "WanTransformer3DModel", (("blocks", "attn1"),), frames_dim=2, text_first=False,
                 patch_sizes=_wan_patch),
    ModelAdapter("hunyuan_video", "HunyuanVideoTransformer3DModel",
                 (("transformer_blocks", "attn"), ("single_transformer_blocks", "attn")), frames_dim=2,
                 text_first=False, patch_sizes=_square_patch),
    ModelAdapter("cogvideox", "CogVideoXTransformer3DModel", (("transformer_blocks", "attn1"),), frames_dim=1,
                 text_first=True, patch_sizes=_square_patch),
)


def adapter_for(transformer) -> ModelAdapter:
    """The adapter for ``transformer`` (matched on its class or a base class); TypeError if unsupported."""
    if not isinstance(transformer, torch.nn.Module):
        raise TypeError(f"transformer must be a torch.nn.Module (a diffusers transformer), "
                        f"got {type(transformer).__name__}")
    mro_names = {cls.__name__ for cls in type(transformer).__mro__}
    for adapter in ADAPTERS:
        if adapter.class_name in mro_names:
            return adapter
    supported = ", ".join(a.class_name for a in ADAPTERS)
    raise TypeError(f"transformer of type {type(transformer).__name__} is not supported; supported: {supported}. "
                    f"Pass the pipeline's transformer (e.g. pipe.transformer), not the pipeline.")


def forward_argument(transformer: torch.nn.Module, name: str, args: tuple, kwargs: dict):
    """The value of forward argument ``name`` in a call ``transformer(*args, **kwargs)`` (None if absent)."""
    if name in kwargs:
        return kwargs[name]
    params = list(inspect.signature(transformer.forward).parameters)
    if name in params and params.index(name) < len(args):
        return args[params.index(name)]
    return None
