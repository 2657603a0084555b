"""The built-in model as a pipeline that sparsevid's cache samples from (``sparsevid.data.cache_synthetic``), so that
its fine-tuning data can be made exactly as a real model's: clips of its own dense sampling, stored with their
caption states in a latent shard folder.

The model works in pixel space: its "latents" are the clips [3, T, H, W] themselves (VAE factors 1), and its caption
encoder plays the text encoder.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch

from sparsevid.data import Encoder, Family

from .builtin import BuiltinVideoDiT
from .sampling import generate


class BuiltinPipeline:
    """Sampling and prompt encoding of a :class:`BuiltinVideoDiT`, called as a diffusers video pipeline is by
    ``cache_synthetic``: ``pipe(prompt=[...], height, width, num_frames, num_inference_steps, guidance_scale,
    output_type="latent", generator=[...])`` -> ``.frames`` float32 [B, 3, T, H, W] in [-1, 1]."""

    vae_scale_factor_temporal = 1
    vae_scale_factor_spatial = 1

    def __init__(self, model: BuiltinVideoDiT):
        self.model = model
        self.transformer = model.transformer
        parameter = next(model.parameters())
        self.device, self.dtype = parameter.device, parameter.dtype

    def __call__(self, prompt: list[str], height: int, width: int, num_frames: int, num_inference_steps: int,
                 guidance_scale: float, output_type: str, generator: list[torch.Generator]) -> SimpleNamespace:
        if output_type != "latent":
            raise ValueError(f"output_type must be 'latent' (the model's clips are its latents), got {output_type!r}")
        if len(prompt) != len(generator):
            raise ValueError(f"one generator per prompt: {len(prompt)} prompts, {len(generator)} generators")
        self.model.use_clip(num_frames, height, width)
        seeds = [int(torch.randint(2**62, (1,), generator=g)) for g in generator]  # the clip's noise seed
        clips = generate(self.model, prompt, seeds, steps=num_inference_steps, guidance=guidance_scale)
        return SimpleNamespace(frames=clips)

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> torch.Tensor:
        """Caption states float32 [B, L, D] of ``prompts``."""
        encoder = self.model.caption_encoder
        return encoder(self.model.tokenize(prompts).to(self.device)).float()


def _prompt(pipe: BuiltinPipeline, prompts: list[str], device: torch.device):
    """(caption states [B, L, D], no mask: the transformer takes none, word counts)."""
    return pipe.encode(prompts).to(device), None, [len(prompt.split()) for prompt in prompts]


def builtin_encoder(model: BuiltinVideoDiT, source: str = "sparsevid_lab builtin") -> Encoder:
    """``model`` as the encoder ``sparsevid.data.cache_synthetic`` samples from: family "builtin" (captions of
    ``model.data.caption_length`` words, pixel-space clips)."""
    family = Family(name="builtin", pipelines=(BuiltinPipeline.__name__,), text_length=model.data.caption_length,
                    normalise=lambda vae, latents: latents, encode_prompt=_prompt,
                    patch=lambda config: int(config["patch_size"][1]))
    return Encoder(BuiltinPipeline(model), family, dict(model.transformer.config), source)
