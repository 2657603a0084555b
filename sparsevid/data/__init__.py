"""Procedural captioned video data for training and evaluating the built-in video DiT."""
from .grammar import VOCAB, tokenize
from .mix import ClipMix, weighted_cycle
from .procedural import ProceduralVideos, Scenes

__all__ = ["VOCAB", "ClipMix", "ProceduralVideos", "Scenes", "tokenize", "weighted_cycle"]
