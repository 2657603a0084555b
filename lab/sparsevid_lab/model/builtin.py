"""The built-in small video DiT: a diffusers ``WanTransformer3DModel`` in pixel space plus a caption encoder.

Clips are RGB float [B, 3, T, H, W] in [-1, 1]; with the default patch (1, 4, 4) a 16 x 64 x 64 clip is
16 x 16 x 16 = 4,096 tokens, attended by 2 heads of dimension 128 in each of 6 layers. The model predicts
the rectified-flow velocity ``noise - clip`` at noise level t in [0, 1] (see :mod:`sparsevid.training.flow`).

The trained weights ship in ``sparsevid_lab/assets/`` (``builtin.safetensors`` + ``builtin.json``);
:func:`load_builtin` loads them. To sparsevid's training path the model is what a real one is: a diffusers
transformer (``model.transformer``) whose text states come from an encoder (its caption encoder); see
:class:`CaptionedClips`.
"""
from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from torch import nn

from sparsevid.training import (LatentBatch, flow_matching_loss, noisy, save_safetensors_atomic,
                                write_text_atomic)

from ..data import ProceduralVideos, grammar
from .caption_encoder import CaptionEncoder

ASSETS = Path(__file__).resolve().parent.parent / "assets"
WEIGHTS_FILE, CONFIG_FILE = "builtin.safetensors", "builtin.json"

DEFAULT_CONFIG = {
    "transformer": {
        "patch_size": [1, 4, 4], "num_attention_heads": 2, "attention_head_dim": 128, "in_channels": 3,
        "out_channels": 3, "text_dim": 128, "freq_dim": 256, "ffn_dim": 1024, "num_layers": 6,
        "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "eps": 1e-6, "rope_max_seq_len": 1024,
    },
    "caption_encoder": {"dim": 128, "layers": 2, "heads": 4},
    "data": {"frames": 16, "height": 64, "width": 64, "max_objects": 3},
    "sampling": {"scheduler": "unipc", "shift": 5.0, "steps": 10, "guidance": 4.0},
}


def tiny_config() -> dict:
    """A ~0.1M-parameter variant (1 layer, head dim 32, 4 x 32 x 32 clips = 256 tokens) for tests and smoke runs."""
    config = copy.deepcopy(DEFAULT_CONFIG)
    config["transformer"].update(num_attention_heads=2, attention_head_dim=32, text_dim=32, freq_dim=32,
                                 ffn_dim=64, num_layers=1)
    config["caption_encoder"].update(dim=32, layers=1, heads=2)
    config["data"].update(frames=4, height=32, width=32, max_objects=2)
    config["sampling"].update(steps=4)
    return config


def check_clip_shape(patch_size, frames: int, height: int, width: int) -> None:
    """ValueError unless frames, height and width are positive multiples of ``patch_size`` (t, h, w)."""
    for name, size, step in zip(("frames", "height", "width"), (frames, height, width), patch_size):
        if size < 1 or size % step:
            raise ValueError(f"clip {name} must be a positive multiple of the patch size {step}, got {size}")


class BuiltinVideoDiT(nn.Module):
    """Caption encoder + Wan transformer. ``config`` has the layout of :data:`DEFAULT_CONFIG`."""

    def __init__(self, config: dict):
        super().__init__()
        from diffusers import WanTransformer3DModel

        missing = {"transformer", "caption_encoder", "data", "sampling"} - set(config)
        if missing:
            raise ValueError(f"config lacks the sections {sorted(missing)}")
        self.config = copy.deepcopy(config)
        self.data = ProceduralVideos(**config["data"])
        tcfg = dict(config["transformer"], patch_size=tuple(config["transformer"]["patch_size"]))
        cap = config["caption_encoder"]
        if cap["dim"] != tcfg["text_dim"]:
            raise ValueError(f"caption_encoder.dim ({cap['dim']}) must equal transformer.text_dim ({tcfg['text_dim']})")
        self.caption_encoder = CaptionEncoder(len(grammar.VOCAB), self.data.caption_length, **cap)
        self.transformer = WanTransformer3DModel(**tcfg)

    @property
    def clip_shape(self) -> tuple[int, int, int, int]:
        """(channels, frames, height, width) of the clips the model was made for."""
        d = self.data
        return (self.config["transformer"]["in_channels"], d.frames, d.height, d.width)

    def use_clip(self, frames: int, height: int, width: int) -> None:
        """Generate and evaluate clips of ``frames`` x ``height`` x ``width`` from now on (the weights serve any
        shape whose sizes are multiples of the patch size; quality depends on the shapes they were trained on)."""
        check_clip_shape(self.config["transformer"]["patch_size"], frames, height, width)
        self.config["data"].update(frames=frames, height=height, width=width)
        self.data = ProceduralVideos(**self.config["data"])

    def use_cpu_defaults(self, clip: bool = True, steps: bool = True) -> dict:
        """Switch to the model's CPU defaults, ``config["sampling"]["cpu"]`` (e.g. ``{"clip": [16, 64, 64],
        "steps": 6}``: a shorter clip and fewer sampler steps, so that a 2-core CPU samples a clip in seconds
        rather than minutes): the clip shape (unless ``clip`` is False) and the sampler steps (unless ``steps``
        is False) become these. Returns what changed, {} for a model without CPU defaults."""
        cpu = self.config["sampling"].get("cpu", {})
        changed = {}
        if clip and "clip" in cpu:
            self.use_clip(*cpu["clip"])
            changed["clip"] = list(cpu["clip"])
        if steps and "steps" in cpu:
            self.config["sampling"]["steps"] = changed["steps"] = int(cpu["steps"])
        return changed

    def tokenize(self, captions: list[str] | str) -> torch.Tensor:
        """Word ids int64 [B, L] of ``captions`` ("" is the null caption)."""
        return self.data.tokenize(captions)

    def forward(self, x: torch.Tensor, t: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Velocity [B, 3, T, H, W] for noisy clips ``x`` [B, 3, T, H, W] at noise levels ``t`` [B] in [0, 1]."""
        states = self.caption_encoder(tokens)
        return self.transformer(x, t * 1000.0, states, return_dict=False)[0]


def deepen(model: BuiltinVideoDiT, layers: int) -> BuiltinVideoDiT:
    """A copy of ``model`` with ``layers`` transformer blocks that computes what ``model`` computes (depth
    up-scaling, to give a trained model more capacity without starting over).

    Of the model's L blocks, block i fills the new places j with j * L // layers == i, in order; its first copy
    keeps the weights, the others start with zero output layers (self-attention, cross-attention and
    feed-forward outputs), so that they add nothing to the residual stream until trained.
    """
    if not isinstance(layers, int) or isinstance(layers, bool):
        raise TypeError(f"layers must be an int, got {type(layers).__name__}")
    old = model.config["transformer"]["num_layers"]
    if layers < old:
        raise ValueError(f"layers must be at least the model's {old} blocks, got {layers}")
    config = copy.deepcopy(model.config)
    config["transformer"]["num_layers"] = layers
    parameter = next(model.parameters())
    grown = BuiltinVideoDiT(config).to(parameter.device, parameter.dtype)
    outside = {k: v for k, v in model.state_dict().items() if not k.startswith("transformer.blocks.")}
    missing, unexpected = grown.load_state_dict(outside, strict=False)
    if unexpected or any(not k.startswith("transformer.blocks.") for k in missing):
        raise RuntimeError(f"the grown model does not match the original outside its blocks: {missing + unexpected}")
    for j, block in enumerate(grown.transformer.blocks):
        source = j * old // layers
        block.load_state_dict(model.transformer.blocks[source].state_dict())
        if j > 0 and (j - 1) * old // layers == source:  # a later copy: silent until trained
            for output in (block.attn1.to_out[0], block.attn2.to_out[0], block.ffn.net[2]):
                nn.init.zeros_(output.weight)
                nn.init.zeros_(output.bias)
    return grown.train(model.training)


def check_model_dtype(dtype) -> None:
    """``dtype`` is a floating-point ``torch.dtype`` (what a model's weights can be cast to and run in)."""
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating-point torch.dtype (e.g. torch.bfloat16), got {dtype!r}")


def load_builtin(directory: str | Path | None = None, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32) -> BuiltinVideoDiT:
    """The built-in model from ``directory`` (default: the shipped assets), in eval mode on ``device``."""
    from safetensors.torch import load_file

    check_model_dtype(dtype)
    directory = Path(directory) if directory is not None else ASSETS
    weights, config_path = directory / WEIGHTS_FILE, directory / CONFIG_FILE
    for path in (weights, config_path):
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found (train the model with `python -m sparsevid_lab train`)")
    model = BuiltinVideoDiT(json.loads(config_path.read_text()))
    model.load_state_dict(load_file(str(weights)))  # copied into the fp32 parameters, cast on the way
    return model.to(device, dtype).eval()


def export_builtin(model, directory: str | Path, dtype: torch.dtype = torch.bfloat16,
                   extra: dict | None = None) -> Path:
    """Write a :class:`BuiltinVideoDiT`'s weights (in ``dtype``) and config (plus ``extra`` entries) into
    ``directory`` as :func:`load_builtin` reads them. Returns the weights path."""
    directory = Path(directory)
    tensors = {name: p.detach().to("cpu", dtype) for name, p in model.state_dict().items()}
    weights = save_safetensors_atomic(tensors, directory / WEIGHTS_FILE)
    write_text_atomic(json.dumps({**model.config, **(extra or {})}, indent=2), directory / CONFIG_FILE)
    return weights


def pretraining_loss(model: BuiltinVideoDiT, x0: torch.Tensor, tokens: torch.Tensor, t: torch.Tensor,
                     noise: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
    """The model's pre-training objective: the flow-matching loss of its velocity at x_t = (1 - t) x0 + t noise.

    x0, noise: [B, 3, T, H, W]; tokens: int64 [B, L]; t: [B] in [0, 1]; weight: see
    :func:`sparsevid.training.weighted_squared_error`."""
    return flow_matching_loss(model(noisy(x0, noise, t), t, tokens), x0, noise, weight)


def pretraining_noise(model: BuiltinVideoDiT, shift: float | None = None,
                      null_prob: float | None = None) -> tuple[float, float]:
    """(time shift, caption-dropout probability) for fine-tuning ``model``: the given values, else those it was
    pre-trained with (its config's "training" arguments), else 1.0 and 0.1."""
    arguments = model.config.get("training", {}).get("arguments", {})
    return (arguments.get("train_shift", 1.0) if shift is None else shift,
            arguments.get("null_prob", 0.1) if null_prob is None else null_prob)


class CaptionedClips:
    """Clips of the built-in model as a latent source of sparsevid's training path
    (:mod:`sparsevid.training.latents`): the pixels are its latents, its frozen caption encoder makes the text
    states, as a real model's VAE and text encoder would.

    Args:
        model: the BuiltinVideoDiT whose caption encoder encodes the captions (not trained by the path, which
            fine-tunes ``model.transformer``).
        clips: a clip source: ``clips(indices, device) -> (video float32 [B, 3, T, H, W], captions)``,
            ``clip_shape`` and ``describe()`` (:mod:`sparsevid_lab.data.sources`).
    """

    def __init__(self, model: BuiltinVideoDiT, clips):
        self.model, self.clips = model, clips
        self.latent_shape = tuple(clips.clip_shape)
        self.text_shape = (model.data.caption_length, model.config["caption_encoder"]["dim"])

    @torch.no_grad()
    def encode(self, captions: list[str], device: torch.device | str) -> torch.Tensor:
        """Caption states [B, L, D] of ``captions`` on ``device``."""
        encoder = self.model.caption_encoder
        tokens = self.model.tokenize(captions).to(next(encoder.parameters()).device)
        return encoder(tokens).to(device)

    def batch(self, indices, device: torch.device | str = "cpu") -> LatentBatch:
        video, captions = self.clips.clips(indices, device)
        return LatentBatch(video, self.encode(captions, device))

    def null_text(self) -> tuple[torch.Tensor, None]:
        return self.encode([""], "cpu")[0], None

    def describe(self) -> dict:
        return self.clips.describe()
