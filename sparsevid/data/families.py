"""What differs between diffusers video pipeline families when turning pixels and prompts into the inputs of
their transformer: data, one :class:`Family` per family, looked up by the pipeline's class name.

Everything else (the VAE's compression factors, the frame-count rule ``k * temporal + 1``, sampling with
``output_type="latent"``) is common to the families' pipelines and lives in :mod:`.cache`.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class Family:
    """One pipeline family.

    Attributes:
        name: the family's name (recorded in the cache's settings).
        pipelines: the diffusers pipeline class names it covers.
        text_length: the prompt length (tokens) the pipeline pads and truncates to when it samples.
        normalise: (vae, latents float32 [B, C, T, H, W] from the VAE's posterior) -> the transformer's latents,
            as the pipeline maps them before its transformer (the inverse of what it does before decoding).
        encode_prompt: (pipe, prompts list[str], device) -> (text [B, L, D] exactly as the pipeline passes it to
            its transformer, text_mask [B, L] if the transformer takes one (``encoder_attention_mask``) else None,
            the prompt's token count per prompt list[int]), optionally with a fourth element: further per-prompt
            transformer inputs {forward argument: tensor [B, ...]} (HunyuanVideo's ``pooled_projections``).
        patch: the transformer config -> its spatial patch size (latent pixels per token side).
        clip_inputs: (pipe, the clip's frame rate, the guidance scale it is sampled at; None: the pipeline's default
            for that argument) -> the transformer inputs that how a clip is made fixes, as the pipeline passes them
            {forward argument: tensor [...]} (HunyuanVideo's embedded ``guidance``); None: there are none.
        compression: pipe -> the VAE's (temporal, spatial) compression factors.
        unpack: for a pipeline whose sampler ends with latents in another layout (LTX: tokens [B, N, C]), (pipe, its
            ``output_type="latent"`` output, the latent grid (T, H, W)) -> latents [B, C, T, H, W]; None: they are.
        guidance_distilled: the transformer takes the guidance scale as an input (HunyuanVideo's embedded guidance)
            instead of the pipeline combining two predictions (classifier-free guidance).
    """

    name: str
    pipelines: tuple[str, ...]
    text_length: int
    normalise: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]
    encode_prompt: Callable[[object, list[str], torch.device], tuple[torch.Tensor, torch.Tensor | None, list[int]]]
    patch: Callable[[dict], int]
    clip_inputs: Callable[[object, float | None, float | None], dict[str, torch.Tensor]] | None = None
    compression: Callable[[object], tuple[int, int]] = lambda pipe: (int(pipe.vae_scale_factor_temporal),
                                                                     int(pipe.vae_scale_factor_spatial))
    unpack: Callable[[object, torch.Tensor, tuple[int, int, int]], torch.Tensor] | None = None
    guidance_distilled: bool = False

    def synthetic_guidance(self, pipe) -> float:
        """The guidance scale the teacher samples fine-tuning data at when none is given: 1 (unguided, one transformer
        call per step: the distribution the model learned; on the built-in model guided samples made worse students,
        docs/distillation.md) for classifier-free guidance, the pipeline's own default for a guidance-distilled
        transformer, which was trained at it."""
        return float(_call_default(pipe, "guidance_scale")) if self.guidance_distilled else 1.0


def _per_channel(values, latents: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=latents.dtype, device=latents.device).view(1, -1, 1, 1, 1)


def _wan_normalise(vae, latents: torch.Tensor) -> torch.Tensor:
    """(z - latents_mean) / latents_std per channel (WanPipeline decodes z = x * std + mean)."""
    return (latents - _per_channel(vae.config.latents_mean, latents)) / _per_channel(vae.config.latents_std, latents)


def _token_counts(pipe, prompts: list[str], length: int) -> list[int]:
    tokens = pipe.tokenizer(prompts, padding="max_length", max_length=length, truncation=True,
                            add_special_tokens=True, return_attention_mask=True, return_tensors="pt")
    return tokens.attention_mask.sum(dim=1).tolist()


def _wan_prompt(pipe, prompts: list[str], device: torch.device):
    """Wan's transformer takes no text mask: the pipeline zeroes the states past each prompt's tokens."""
    text, _ = pipe.encode_prompt(prompts, do_classifier_free_guidance=False, max_sequence_length=WAN.text_length,
                                 device=device)
    return text, None, _token_counts(pipe, prompts, WAN.text_length)


WAN = Family(name="wan", pipelines=("WanPipeline", "WanVideoToVideoPipeline"), text_length=512,
             normalise=_wan_normalise, encode_prompt=_wan_prompt, patch=lambda config: int(config["patch_size"][1]))


def _scaled(vae, latents: torch.Tensor) -> torch.Tensor:
    """z * scaling_factor (HunyuanVideoPipeline decodes z = x / scaling_factor)."""
    return latents * vae.config.scaling_factor


def _hunyuan_prompt(pipe, prompts: list[str], device: torch.device):
    """The LLM's states with their mask (the prompt template's tokens cropped, as the pipeline does) and CLIP's
    pooled projection [B, P]."""
    text, pooled, mask = pipe.encode_prompt(prompts, device=device, max_sequence_length=HUNYUAN_VIDEO.text_length)
    return text, mask, mask.sum(dim=1).tolist(), {"pooled_projections": pooled}


def _call_default(pipe, argument: str):
    """The default of ``argument`` of the pipeline's ``__call__``."""
    return inspect.signature(type(pipe).__call__).parameters[argument].default


def _embedded_guidance(pipe, fps: float | None, guidance: float | None) -> dict[str, torch.Tensor]:
    """A guidance-distilled transformer's ``guidance``: 1000 x the scale (the pipeline's default for videos)."""
    scale = _call_default(pipe, "guidance_scale") if guidance is None else guidance
    return {"guidance": torch.tensor(1000.0 * scale)}


HUNYUAN_VIDEO = Family(name="hunyuan_video", pipelines=("HunyuanVideoPipeline",), text_length=256,
                       normalise=_scaled, encode_prompt=_hunyuan_prompt,
                       patch=lambda config: int(config["patch_size"]), clip_inputs=_embedded_guidance,
                       guidance_distilled=True)


def _ltx_normalise(vae, latents: torch.Tensor) -> torch.Tensor:
    """(z - latents_mean) * scaling_factor / latents_std per channel, the VAE's own buffers (as LTXPipeline)."""
    shape = (1, -1, 1, 1, 1)
    mean, std = (buffer.to(latents).view(shape) for buffer in (vae.latents_mean, vae.latents_std))
    return (latents - mean) * vae.config.scaling_factor / std


def _masked_t5_prompt(pipe, prompts: list[str], device: torch.device):
    """T5's states with their mask (bool), at the family's text length (LTX-Video, Mochi)."""
    length = family_for(type(pipe).__name__).text_length
    text, mask, _, _ = pipe.encode_prompt(prompts, do_classifier_free_guidance=False, max_sequence_length=length,
                                          device=device)
    return text, mask, mask.sum(dim=1).tolist()


def _ltx_rope_scale(pipe, fps: float | None, guidance: float | None) -> dict[str, torch.Tensor]:
    """``rope_interpolation_scale`` [3]: (temporal factor / frame rate, spatial factor, spatial factor); the
    pipeline's default ``frame_rate`` for a clip of unknown rate."""
    rate = _call_default(pipe, "frame_rate") if fps is None else fps
    temporal, spatial = LTX.compression(pipe)
    return {"rope_interpolation_scale": torch.tensor([temporal / rate, spatial, spatial], dtype=torch.float64)}


def _ltx_unpack(pipe, tokens: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
    """The sampler's tokens [B, N, C p_t p p] as latents [B, C, T, H, W] (the pipeline's own unpacking)."""
    return pipe._unpack_latents(tokens, *grid, pipe.transformer_spatial_patch_size,
                                pipe.transformer_temporal_patch_size)


LTX = Family(name="ltx", pipelines=("LTXPipeline",), text_length=128, normalise=_ltx_normalise,
             encode_prompt=_masked_t5_prompt, patch=lambda config: int(config["patch_size"]),
             clip_inputs=_ltx_rope_scale,
             compression=lambda pipe: (int(pipe.vae_temporal_compression_ratio),
                                       int(pipe.vae_spatial_compression_ratio)),
             unpack=_ltx_unpack)


def _mochi_normalise(vae, latents: torch.Tensor) -> torch.Tensor:
    """(z - latents_mean) * scaling_factor / latents_std per channel (MochiPipeline decodes
    z = x * latents_std / scaling_factor + latents_mean; z * scaling_factor for a VAE without the statistics)."""
    mean, std = vae.config.latents_mean, vae.config.latents_std
    if mean is None or std is None:
        return latents * vae.config.scaling_factor
    return (latents - _per_channel(mean, latents)) * vae.config.scaling_factor / _per_channel(std, latents)


MOCHI = Family(name="mochi", pipelines=("MochiPipeline",), text_length=256, normalise=_mochi_normalise,
               encode_prompt=_masked_t5_prompt, patch=lambda config: int(config["patch_size"]),
               compression=lambda pipe: (int(pipe.vae_temporal_scale_factor), int(pipe.vae_spatial_scale_factor)))

FAMILIES = (WAN, HUNYUAN_VIDEO, LTX, MOCHI)


def family_for(pipeline_class: str) -> Family:
    """The family of the diffusers pipeline class named ``pipeline_class`` (TypeError for one not supported)."""
    for family in FAMILIES:
        if pipeline_class in family.pipelines:
            return family
    supported = sorted(name for family in FAMILIES for name in family.pipelines)
    raise TypeError(f"sparsevid cache supports the pipelines {supported}, not {pipeline_class}")
