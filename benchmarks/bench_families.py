"""Whole-transformer forward of every supported video family at its real size: dense (diffusers' native attention,
torch's SDPA; cuDNN on the H200 where the inputs allow) vs sparsevid top-k 5% and hybrid (top-k 5%, top-p 0.9),
eager and compiled.

Each family is built from the transformer config of its public diffusers checkpoint (``FAMILIES``: the checkpoint
id and where the values were read) with random weights, directly on the device in bf16 (the modules diffusers keeps
in fp32 stay fp32), and called at its pipeline's usual resolution with random inputs of the shapes the pipeline
passes (latents after the VAE's compression, text states padded to the pipeline's length). Per family and compile
mode it reports the median forward (CUDA-synchronised wall clock), the achieved sparsity (from one eager forward
with stats) and the speed-up of each sparse setting against dense in the same mode. Compiled rows use diffusers'
``compile_repeated_blocks`` where the model defines ``_repeated_blocks``, else ``torch.compile`` of the whole model.
A family that fails is recorded with its error and the run goes on (exit status 1 at the end).

    python -m benchmarks families            # the families that fit one GPU call together; also families_a14b, ...
    python -m benchmarks families --estimate # estimated device seconds per family, nothing run
    # CPU smoke run of the same code path:
    python -m benchmarks --results /tmp/fam families --device cpu --dtype float32 --layers 1 --heads 2 \\
        --grid 2x4x4 --text-tokens 8 --compile eager --warmup 0 --iters 1
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import torch

import sparsevid as sv
from sparsevid.integration import adapter_for
from .bench_e2e import (build_model, compiled, dense_sdpa_context, layer_breakdown, parse_grid, sync,
                        time_forward, uncompile)
from .report import write_result
from .run_info import run_metadata

TIMESTEP = 900.0
VALID_TEXT = 128  # prompt tokens of a padded text (the rest is padding, masked where the family takes a mask)
SETTINGS = {"dense": None,
            "top-k 5%": {"rule": "topk", "topk": 0.05},
            "hybrid": {"rule": "hybrid", "topk": 0.05, "topp": 0.9}}


@dataclass(frozen=True)
class Family:
    """A model at its pipeline's resolution: ``config`` of the checkpoint named in ``source``; ``video`` (frames,
    height, width) in pixels, ``vae`` (temporal, spatial) compression, ``patch`` (temporal, spatial) patching;
    ``inputs(model, grid, draw, device, text_tokens)`` makes the forward's keyword arguments (``draw(*shape)``:
    random values on the device; ``text_tokens``: the padded text length, by default the pipeline's
    ``text_tokens``); ``joint_text``: text tokens that join the video in one attention (0 where text comes through
    cross-attention); ``layer_keys``: the config's layer counts (set by --layers); ``derived(config)``: config
    values that follow from others (under --layers / --heads)."""
    label: str
    source: str
    model_class: str
    config: dict
    video: tuple[int, int, int]
    vae: tuple[int, int]
    patch: tuple[int, int]
    inputs: Callable
    text_tokens: int
    joint_text: int = 0
    layer_keys: tuple[str, ...] = ("num_layers",)
    derived: Callable[[dict], dict] = field(default=lambda config: {})

    def grid(self) -> tuple[int, int, int]:
        """Video tokens (T, H, W) after the VAE and patching."""
        frames, height, width = self.video
        (temporal, spatial), (p_t, p_s) = self.vae, self.patch
        return ((frames - 1) // temporal + 1) // p_t, height // spatial // p_s, width // spatial // p_s


def latents(model, grid, patch, draw, channels_dim=1, channels=None):
    """Random latents [1, C, T, H, W] (``channels_dim=2``: [1, T, C, H, W]) of token ``grid`` before ``patch``;
    C: ``channels``, by default the model's ``in_channels``."""
    frames, height, width = grid[0] * patch[0], grid[1] * patch[1], grid[2] * patch[1]
    shape = [1, frames, height, width]
    shape.insert(channels_dim, channels or model.config.in_channels)
    return draw(*shape)


def text_mask(slots: int, valid: int, device) -> torch.Tensor:
    """[1, slots] int64: the first ``valid`` text tokens real, the rest padding."""
    mask = torch.zeros(1, slots, dtype=torch.long, device=device)
    mask[:, :valid] = 1
    return mask


def wan_inputs(model, grid, draw, device, text_tokens):
    return {"hidden_states": latents(model, grid, (1, 2), draw), "timestep": torch.tensor([TIMESTEP], device=device),
            "encoder_hidden_states": draw(1, text_tokens, model.config.text_dim), "return_dict": False}


def wan22_ti2v_inputs(model, grid, draw, device, text_tokens):
    """Wan2.2 TI2V-5B as its image-to-video pipeline calls it: a per-token timestep [1, N], the first (image) frame
    at 0."""
    frames, height, width = grid
    timestep = torch.full((1, frames * height * width), TIMESTEP, device=device)
    timestep[:, :height * width] = 0.0
    return {**wan_inputs(model, grid, draw, device, text_tokens), "timestep": timestep}


def skyreels_inputs(model, grid, draw, device, text_tokens):
    """SkyReels-V2 diffusion forcing, synchronous (every latent frame at the same step): per-frame timesteps
    [1, T] and the fps flag its pipeline passes (1 for 24 fps)."""
    return {**wan_inputs(model, grid, draw, device, text_tokens),
            "timestep": torch.full((1, grid[0]), TIMESTEP, device=device), "enable_diffusion_forcing": True,
            "fps": [1]}


def wan_vace_inputs(model, grid, draw, device, text_tokens):
    """A control video (reference frames and masks, ``vace_in_channels``) on the video's latent grid, every VACE
    hint at scale 1."""
    control = latents(model, grid, (1, 2), draw, channels=model.config.vace_in_channels)
    return {**wan_inputs(model, grid, draw, device, text_tokens), "control_hidden_states": control,
            "control_hidden_states_scale": torch.ones(len(model.config.vace_layers), device=device)}


def hunyuan_video_inputs(model, grid, draw, device, text_tokens):
    return {"hidden_states": latents(model, grid, (1, 2), draw), "timestep": torch.tensor([TIMESTEP], device=device),
            "encoder_hidden_states": draw(1, text_tokens, model.config.text_embed_dim),
            "encoder_attention_mask": text_mask(text_tokens, min(VALID_TEXT, text_tokens), device),
            "pooled_projections": draw(1, model.config.pooled_projection_dim),
            "guidance": torch.tensor([6000.0], device=device), "return_dict": False}


# HunyuanVideo 1.5's pipeline: Qwen2.5-VL text padded to 1000 tokens, byT5 glyph text to 256 (all padding without
# quoted text), SigLIP image tokens (729, zeros for text-to-video).
HV15_TEXT_2, HV15_IMAGE = 256, 729


def hunyuan_video15_inputs(model, grid, draw, device, text_tokens):
    """Text-to-video as the pipeline calls it: latents with the (zero) condition latents and mask channels, the
    timestep in the model's dtype (its time embedding casts the sinusoid to the timestep's dtype)."""
    text_2 = min(HV15_TEXT_2, text_tokens)
    image = min(HV15_IMAGE, text_tokens)
    return {"hidden_states": latents(model, grid, (1, 1), draw),
            "timestep": torch.tensor([TIMESTEP], device=device, dtype=model.dtype),
            "encoder_hidden_states": draw(1, text_tokens, model.config.text_embed_dim),
            "encoder_attention_mask": text_mask(text_tokens, min(VALID_TEXT, text_tokens), device),
            "encoder_hidden_states_2": draw(1, text_2, model.config.text_embed_2_dim),
            "encoder_attention_mask_2": text_mask(text_2, 0, device),
            "image_embeds": torch.zeros(1, image, model.config.image_embed_dim, device=device,
                                        dtype=model.dtype), "return_dict": False}


def ltx_inputs(model, grid, draw, device, text_tokens):
    """Patched tokens [1, N, C] with the grid as arguments; RoPE scaled as the pipeline does at 25 fps."""
    frames, height, width = grid
    return {"hidden_states": draw(1, frames * height * width, model.config.in_channels),
            "encoder_hidden_states": draw(1, text_tokens, model.config.caption_channels),
            "timestep": torch.tensor([TIMESTEP], device=device),
            "encoder_attention_mask": text_mask(text_tokens, min(VALID_TEXT, text_tokens), device),
            "num_frames": frames, "height": height, "width": width, "rope_interpolation_scale": (8 / 25, 32, 32),
            "return_dict": False}


def cogvideox_inputs(model, grid, draw, device, text_tokens):
    """Latents [1, T, C, H, W] and the RoPE tables made by the pipeline's own method."""
    from diffusers import CogVideoXPipeline

    frames, height, width = grid
    spatial = 8 * model.config.patch_size
    pipe = SimpleNamespace(vae_scale_factor_spatial=8, transformer=model)
    rope = CogVideoXPipeline._prepare_rotary_positional_embeddings(pipe, height * spatial, width * spatial, frames,
                                                                   device)
    return {"hidden_states": latents(model, grid, (1, 2), draw, channels_dim=2),
            "encoder_hidden_states": draw(1, text_tokens, model.config.text_embed_dim),
            "timestep": torch.tensor([TIMESTEP], device=device), "image_rotary_emb": rope, "return_dict": False}


def mochi_inputs(model, grid, draw, device, text_tokens):
    """As MochiPipeline calls it (one prompt, no guidance batch): latents [1, C, T, H, W], the other families' noise
    level in Mochi's inverted time (timestep 1000 - 900), T5 text padded to 256 tokens with its boolean mask (the
    processor attends the valid tokens only)."""
    timestep = adapter_for(model).flow_timestep(TIMESTEP)
    return {"hidden_states": latents(model, grid, (1, 2), draw), "timestep": torch.tensor([timestep], device=device),
            "encoder_hidden_states": draw(1, text_tokens, model.config.text_embed_dim),
            "encoder_attention_mask": text_mask(text_tokens, min(VALID_TEXT, text_tokens), device).bool(),
            "return_dict": False}


# Wan's transformer config: scripts/convert_wan_to_diffusers.py of huggingface/diffusers (the values of the
# published Wan-AI/*-Diffusers transformer/config.json); SkyReels-V2's: scripts/convert_skyreelsv2_to_diffusers.py.
WAN = {"patch_size": (1, 2, 2), "attention_head_dim": 128, "cross_attn_norm": True, "eps": 1e-6, "freq_dim": 256,
       "qk_norm": "rms_norm_across_heads", "text_dim": 4096, "added_kv_proj_dim": None}
WAN_14B = {**WAN, "num_attention_heads": 40, "ffn_dim": 13824, "num_layers": 40, "in_channels": 16,
           "out_channels": 16}
# LTX-Video's 2B transformer (convert_ltx_to_diffusers.py); its cross-attention width is the attention width.
LTX_2B = {"in_channels": 128, "out_channels": 128, "patch_size": 1, "patch_size_t": 1, "num_attention_heads": 32,
          "attention_head_dim": 64, "cross_attention_dim": 2048, "num_layers": 28, "activation_fn": "gelu-approximate",
          "qk_norm": "rms_norm_across_heads", "norm_elementwise_affine": False, "norm_eps": 1e-6,
          "caption_channels": 4096, "attention_bias": True, "attention_out_bias": True}


def ltx_derived(config: dict) -> dict:
    return {"cross_attention_dim": config["num_attention_heads"] * config["attention_head_dim"]}


def vace_derived(config: dict) -> dict:
    """The VACE layers that exist under --layers."""
    return {"vace_layers": [i for i in config["vace_layers"] if i < config["num_layers"]]}

FAMILIES = {
    "wan22_ti2v": Family(
        "Wan2.2 TI2V-5B", "Wan-AI/Wan2.2-TI2V-5B-Diffusers (convert_wan_to_diffusers.py, 'Wan2.2-TI2V-5B'); "
        "pipeline 1280x704, 121 frames, Wan2.2 VAE 4x16x16", "WanTransformer3DModel",
        {**WAN, "num_attention_heads": 24, "ffn_dim": 14336, "num_layers": 30, "in_channels": 48, "out_channels": 48},
        (121, 704, 1280), (4, 16), (1, 2), wan22_ti2v_inputs, 512),
    "wan22_a14b": Family(
        "Wan2.2 A14B (one expert)", "Wan-AI/Wan2.2-T2V-A14B-Diffusers, transformer/ (convert_wan_to_diffusers.py, "
        "'Wan2.2-T2V-A14B'); 1280x720, 81 frames, Wan2.1 VAE 4x8x8", "WanTransformer3DModel", WAN_14B,
        (81, 720, 1280), (4, 8), (1, 2), wan_inputs, 512),
    "hunyuan_video15": Family(
        "HunyuanVideo 1.5 720p", "hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-720p_t2v (class defaults with "
        "target_size 960, task_type t2v: convert_hunyuan_video1_5_to_diffusers.py); pipeline 1280x720 (target 960, "
        "16:9), 121 frames, VAE 4x16x16", "HunyuanVideo15Transformer3DModel",
        {"in_channels": 65, "out_channels": 32, "num_attention_heads": 16, "attention_head_dim": 128, "num_layers": 54,
         "num_refiner_layers": 2, "mlp_ratio": 4.0, "patch_size": 1, "patch_size_t": 1, "qk_norm": "rms_norm",
         "text_embed_dim": 3584, "text_embed_2_dim": 1472, "image_embed_dim": 1152, "rope_theta": 256.0,
         "rope_axes_dim": (16, 56, 56), "target_size": 960, "task_type": "t2v"},
        (121, 720, 1280), (4, 16), (1, 1), hunyuan_video15_inputs, 1000, joint_text=1000 + HV15_TEXT_2 + HV15_IMAGE),
    "ltx": Family(
        "LTX-Video 2B", "Lightricks/LTX-Video 0.9.x 2B (convert_ltx_to_diffusers.py, versions before 0.9.7; the "
        "class defaults); 768x512, 161 frames as in diffusers' LTX docs example, VAE 8x32x32, T5 text 128 tokens",
        "LTXVideoTransformer3DModel", LTX_2B, (161, 512, 768), (8, 32), (1, 1), ltx_inputs, 128, derived=ltx_derived),
    "ltx_13b": Family(
        "LTX-Video 0.9.7 13B", "Lightricks/LTX-Video-0.9.7-dev (convert_ltx_to_diffusers.py, version 0.9.7); the "
        "refinement pass of diffusers' LTX docs example (768x1152 target at 2/3, upsampled 2x: 1536x1024), 161 frames",
        "LTXVideoTransformer3DModel",
        {**LTX_2B, "num_attention_heads": 32, "attention_head_dim": 128, "cross_attention_dim": 4096,
         "num_layers": 48},
        (161, 1024, 1536), (8, 32), (1, 1), ltx_inputs, 128, derived=ltx_derived),
    "skyreels_v2": Family(
        "SkyReels-V2 DF-1.3B 540p", "Skywork/SkyReels-V2-DF-1.3B-540P-Diffusers (convert_skyreelsv2_to_diffusers.py, "
        "'SkyReels-V2-DF-1.3B-540P'); diffusion-forcing pipeline 960x544, 97 frames, Wan2.1 VAE 4x8x8",
        "SkyReelsV2Transformer3DModel",
        {**WAN, "num_attention_heads": 12, "ffn_dim": 8960, "num_layers": 30, "in_channels": 16, "out_channels": 16,
         "inject_sample_info": True},
        (97, 544, 960), (4, 8), (1, 2), skyreels_inputs, 512),
    "wan_vace": Family(
        "Wan2.1 VACE-14B 720p", "Wan-AI/Wan2.1-VACE-14B-diffusers (convert_wan_to_diffusers.py, 'Wan-VACE-14B'); "
        "1280x720, 81 frames, Wan2.1 VAE 4x8x8, control video of 96 latent channels", "WanVACETransformer3DModel",
        {**WAN_14B, "vace_layers": [0, 5, 10, 15, 20, 25, 30, 35], "vace_in_channels": 96},
        (81, 720, 1280), (4, 8), (1, 2), wan_vace_inputs, 512, derived=vace_derived),
    "hunyuan_video": Family(
        "HunyuanVideo 13B 720p", "hunyuanvideo-community/HunyuanVideo (convert_hunyuan_video_to_diffusers.py, "
        "'HYVideo-T/2-cfgdistill'); pipeline 1280x720, 129 frames, VAE 4x8x8, LLaMA text 256 tokens",
        "HunyuanVideoTransformer3DModel",
        {"in_channels": 16, "out_channels": 16, "num_attention_heads": 24, "attention_head_dim": 128, "num_layers": 20,
         "num_single_layers": 40, "num_refiner_layers": 2, "mlp_ratio": 4.0, "patch_size": 2, "patch_size_t": 1,
         "qk_norm": "rms_norm", "guidance_embeds": True, "text_embed_dim": 4096, "pooled_projection_dim": 768,
         "rope_theta": 256.0, "rope_axes_dim": (16, 56, 56), "image_condition_type": None},
        (129, 720, 1280), (4, 8), (1, 2), hunyuan_video_inputs, 256, joint_text=256,
        layer_keys=("num_layers", "num_single_layers")),
    "cogvideox": Family(
        "CogVideoX-5B", "THUDM/CogVideoX-5b (convert_cogvideox_to_diffusers.py: version 1.0, 42 layers, 48 heads, "
        "RoPE); pipeline 720x480, 49 frames, VAE 4x8x8, T5 text 226 tokens", "CogVideoXTransformer3DModel",
        {"num_attention_heads": 48, "attention_head_dim": 64, "in_channels": 16, "out_channels": 16,
         "time_embed_dim": 512, "text_embed_dim": 4096, "num_layers": 42, "sample_width": 90, "sample_height": 60,
         "sample_frames": 49, "patch_size": 2, "patch_size_t": None, "temporal_compression_ratio": 4,
         "max_text_seq_length": 226, "use_rotary_positional_embeddings": True,
         "use_learned_positional_embeddings": False},
        (49, 480, 720), (4, 8), (1, 2), cogvideox_inputs, 226, joint_text=226),
    "mochi": Family(
        "Mochi-1 10B 480p", "genmo/mochi-1-preview, transformer/ (convert_mochi_to_diffusers.py: the class defaults, "
        "48 layers, 24 heads x 128, 12 latent channels); pipeline 848x480, 163 frames, VAE 6x8x8, T5 text 256 tokens",
        "MochiTransformer3DModel",
        {"patch_size": 2, "num_attention_heads": 24, "attention_head_dim": 128, "num_layers": 48,
         "pooled_projection_dim": 1536, "in_channels": 12, "out_channels": None, "qk_norm": "rms_norm",
         "text_embed_dim": 4096, "time_embed_dim": 256, "activation_fn": "swiglu", "max_sequence_length": 256},
        (163, 480, 848), (6, 8), (1, 2), mochi_inputs, 256, joint_text=VALID_TEXT),
}

# Rough H200 rates of the estimate (calibrated on the Wan 1.3B and 14B forwards of GPU.md): dense attention at cuDNN's
# 560 TFLOP/s, everything else at 500; a sparse setting keeps ~8% of the attention time (5% of the tiles and the mask
# prediction); compiling a setting took 22-35 s with compile_repeated_blocks (Wan 14B) and 74-121 s with
# torch.compile of the whole model (Wan 1.3B) in the e2e benchmarks' H200 results.
ATTENTION_FLOPS, OTHER_FLOPS, SPARSE_ATTENTION, COMPILE_S = 560e12, 500e12, 0.08, {"blocks": 35.0, "full": 120.0}


def family_config(family: Family, args) -> dict:
    """The family's transformer config, shrunk by --layers (every layer count) and --heads."""
    config = dict(family.config)
    if args.layers:
        config.update({key: args.layers for key in family.layer_keys})
    if args.heads:
        config["num_attention_heads"] = args.heads
    return {**config, **family.derived(config)}


def estimate(name: str, args) -> dict:
    """Estimated H200 seconds of one family under ``args`` (forward FLOPs from the parameter count of the model
    built on the meta device and the attention shape; build, eager and compiled settings)."""
    import diffusers

    family = FAMILIES[name]
    config = family_config(family, args)
    with torch.device("meta"):
        model = getattr(diffusers, family.model_class)(**config)
    params = sum(p.numel() for p in model.parameters())
    tokens = math.prod(args.grid or family.grid())
    layers = len(adapter_for(model).self_attentions(model))
    width = config["num_attention_heads"] * config["attention_head_dim"]
    attention = 4 * layers * width * (tokens + family.joint_text) ** 2 / ATTENTION_FLOPS
    other = 2 * params * tokens / OTHER_FLOPS
    dense, sparse = attention + other, SPARSE_ATTENTION * attention + other
    calls = args.warmup + args.iters
    eager = calls * dense + (calls + 1) * sparse * (len(SETTINGS) - 1)
    scope = "blocks" if model._repeated_blocks else "full"
    compiled_s = COMPILE_S[scope] + args.iters * dense + (len(SETTINGS) - 1) * (
        COMPILE_S[scope] + (args.iters + 1) * sparse)
    modes = [m for m in args.compile if m != "eager"]
    total = 20 + params / 1e9 * 2 + ("eager" in args.compile) * eager + len(modes) * compiled_s
    return {"family": name, "params_b": params / 1e9, "tokens": tokens, "dense_forward_s": dense,
            "sparse_forward_s": sparse, "total_s": total}


def time_compiled(model, mode: str, scope: str, inputs_list, args, device) -> tuple[list[float], float]:
    """Forward times (ms) of ``model`` compiled in ``mode`` and the seconds of its first (compiling) call."""
    target = compiled(model, mode, scope)
    sync(device)
    start = time.perf_counter()
    target(**inputs_list[0])
    sync(device)
    compile_s = time.perf_counter() - start
    times = time_forward(target, inputs_list, 0, args.iters, device)  # the compiling call was the warm-up
    uncompile(model)
    return times, compile_s


def run_family(name: str, args, device, dtype) -> list[dict]:
    """One row per (setting, compile mode) of family ``name``."""
    family = FAMILIES[name]
    config = family_config(family, args)
    grid = args.grid or family.grid()
    generator = torch.Generator().manual_seed(0)

    def draw(*shape):
        return torch.randn(*shape, generator=generator).to(device, dtype)

    model = build_model(family.model_class, config, device, dtype)
    text_tokens = args.text_tokens or family.text_tokens
    inputs_list = [family.inputs(model, grid, draw, device, text_tokens) for _ in range(2)]
    scope = "blocks" if model._repeated_blocks else "full"
    frames, height, width = family.video
    resolution = f"{width}x{height}, {frames} frames" if args.grid is None else "grid " + "x".join(map(str, grid))
    base = {"family": name, "label": family.label, "source": family.source, "resolution": resolution,
            "grid": list(grid), "tokens": math.prod(grid), "text_tokens": text_tokens, "config": config,
            "params_b": sum(p.numel() for p in model.parameters()) / 1e9}
    rows = []
    with torch.no_grad(), dense_sdpa_context(device, args.dense_backend):
        for setting, mask in SETTINGS.items():
            cfg = sv.SparseConfig(**mask, backend=args.backend) if mask else None
            for mode in args.compile:
                if cfg is not None:
                    sv.apply_sparse_attention(model, cfg)
                row = {**base, "setting": setting, "compile": mode, "sparse_config": cfg and cfg.to_dict()}
                if mode == "eager":
                    times = time_forward(model, inputs_list, args.warmup, args.iters, device)
                else:
                    row["compile_scope"] = scope
                    times, row["compile_s"] = time_compiled(model, mode, scope, inputs_list, args, device)
                if cfg is not None:  # sparsity and attention time per layer from one eager forward with stats
                    breakdown = layer_breakdown(model, inputs_list[0])
                    row.update({"achieved_sparsity": breakdown["sparsity"], "sparse_layers": breakdown["layers"],
                                "eager_attention_ms_per_layer": breakdown["attention_ms"]})
                    sv.remove_sparse_attention(model)
                row.update({"forward_ms": statistics.median(times), "forward_ms_all": times})
                rows.append(row)
                print(f"{family.label:28s} {setting:9s} {mode:10s} forward {row['forward_ms']:10.1f} ms", flush=True)
    for row in rows:  # against dense in the same compile mode
        dense = next(r for r in rows if r["setting"] == "dense" and r["compile"] == row["compile"])
        row["speedup"] = dense["forward_ms"] / row["forward_ms"]
    return rows


def free(device) -> None:
    """Release the previous family's memory before the next is built."""
    gc.collect()
    torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def table(rows: list[dict], errors: list[dict]) -> str:
    """One line per (family, compile mode): forward ms per setting, sparsity and speed-ups."""
    head = ("| family | resolution | tokens | compile | dense ms | top-k ms | hybrid ms | top-k sparsity | "
            "hybrid sparsity | top-k speed-up | hybrid speed-up |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for (name, mode) in dict.fromkeys((r["family"], r["compile"]) for r in rows):
        by = {r["setting"]: r for r in rows if r["family"] == name and r["compile"] == mode}
        sparsity = [format(by[s]["achieved_sparsity"], ".3f") for s in ("top-k 5%", "hybrid")]
        dense = by["dense"]
        lines.append(f"| {dense['label']} | {dense['resolution']} | {dense['tokens']} | {mode} | "
                     f"{dense['forward_ms']:.1f} | {by['top-k 5%']['forward_ms']:.1f} | {by['hybrid']['forward_ms']:.1f} | "
                     f"{sparsity[0]} | {sparsity[1]} | {by['top-k 5%']['speedup']:.2f}x | {by['hybrid']['speedup']:.2f}x |")
    lines += [f"\n{e['family']}: failed: {e['error']}" for e in errors]
    return "\n".join(lines)


def estimate_table(estimates: list[dict]) -> str:
    lines = ["| family | params (B) | tokens | dense forward s | sparse forward s | estimated total s |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {e['family']} | {e['params_b']:.2f} | {e['tokens']} | {e['dense_forward_s']:.1f} | "
              f"{e['sparse_forward_s']:.1f} | {e['total_s']:.0f} |" for e in estimates]
    lines.append(f"| all | | | | | {sum(e['total_s'] for e in estimates):.0f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path,
                        help="folder of the result (<gpu>.json/.md); python -m benchmarks sets it")
    parser.add_argument("--families", default=",".join(FAMILIES), help=f"comma list of {list(FAMILIES)}")
    parser.add_argument("--estimate", action="store_true",
                        help="print the estimated H200 seconds of each family under these options and exit")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--backend", default="auto", choices=["auto", "triton", "flex", "reference"])
    parser.add_argument("--dense-backend", default="default", choices=["default", "cudnn", "flash"],
                        help="SDPA backend of the dense baseline and of dense text rows: 'default' is torch's own "
                             "choice (cuDNN on the H200 where the inputs allow, e.g. not under a [B, 1, N, N] mask)")
    parser.add_argument("--layers", type=int, default=0, help="override every layer count (shrink)")
    parser.add_argument("--heads", type=int, default=0, help="override the number of heads (shrink)")
    parser.add_argument("--grid", type=parse_grid, default=None,
                        help="override the video token grid TxHxW after patching (shrink)")
    parser.add_argument("--text-tokens", type=int, default=0, help="override the padded text length (shrink)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--compile", default="eager,default",
                        help="comma list of 'eager' and torch.compile modes; every setting is timed under each")
    args = parser.parse_args(argv)
    args.compile = args.compile.split(",")
    names = args.families.split(",")
    unknown = [n for n in names if n not in FAMILIES]
    if unknown:
        parser.error(f"--families: unknown {unknown}; choose from {list(FAMILIES)}")
    if args.estimate:
        print(estimate_table([estimate(name, args) for name in names]))
        return 0
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)

    rows, errors = [], []
    for name in names:
        try:
            rows.extend(run_family(name, args, device, dtype))
        except Exception as error:  # recorded; the next family still runs
            traceback.print_exc()
            errors.append({"family": name, "error": f"{type(error).__name__}: {error}"})
        free(device)
    meta = run_metadata(device, dtype=args.dtype, warmup=args.warmup, iters=args.iters, compile=args.compile,
                        dense_backend=args.dense_backend, backend=args.backend, families=names)
    text = table(rows, errors)
    write_result(args.out, meta, {"rows": rows, "errors": errors}, text)
    print(json.dumps(meta))
    print(text)
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
