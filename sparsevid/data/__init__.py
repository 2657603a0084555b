"""Procedural captioned video data for training and evaluating the built-in video DiT."""
from .grammar import VOCAB, tokenize
from .procedural import ProceduralVideos, Scenes

__all__ = ["VOCAB", "ProceduralVideos", "Scenes", "tokenize"]
