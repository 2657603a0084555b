"""A minimal caption encoder: learned word embeddings over the caption grammar, mixed by a small transformer."""
from __future__ import annotations

import torch
from torch import nn


class CaptionEncoder(nn.Module):
    """Word ids int64 [B, L] -> caption states float [B, L, dim] (the DiT's ``encoder_hidden_states``).

    Args:
        vocab_size: number of word ids (id 0 is padding; an all-padding caption is the null caption
            used for classifier-free guidance).
        length: caption length L in words.
        dim: state width; layers, heads: size of the mixing transformer.
    """

    def __init__(self, vocab_size: int, length: int, dim: int = 128, layers: int = 2, heads: int = 4):
        super().__init__()
        for name, value in (("vocab_size", vocab_size), ("length", length), ("dim", dim), ("heads", heads)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not isinstance(layers, int) or layers < 0:
            raise ValueError(f"layers must be a non-negative int, got {layers!r}")
        if dim % heads:
            raise ValueError(f"dim={dim} must be divisible by heads={heads}")
        self.length = length
        self.words = nn.Embedding(vocab_size, dim)
        self.positions = nn.Parameter(torch.randn(length, dim) * 0.02)
        layer = nn.TransformerEncoderLayer(dim, heads, dim_feedforward=2 * dim, dropout=0.0,
                                           activation="gelu", batch_first=True, norm_first=True)
        self.mixer = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False) if layers else nn.Identity()
        self.norm = nn.LayerNorm(dim)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if not isinstance(tokens, torch.Tensor) or tokens.dtype != torch.long or tokens.dim() != 2:
            raise TypeError("tokens must be an int64 tensor [B, L]")
        if tokens.shape[1] != self.length:
            raise ValueError(f"tokens must have length {self.length}, got {tokens.shape[1]}")
        return self.norm(self.mixer(self.words(tokens) + self.positions))
