"""Procedural captioned video data for training and evaluating the built-in video DiT."""
from .grammar import VOCAB, tokenize
from .mix import ClipMix, weighted_cycle
from .procedural import SLICE_FIELDS, ProceduralVideos, Scenes, held_out_captions

__all__ = ["VOCAB", "ClipMix", "ProceduralVideos", "SLICE_FIELDS", "Scenes", "held_out_captions",
           "tokenize", "weighted_cycle"]
