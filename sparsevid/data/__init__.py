"""Preparing training data: videos with captions (or clips sampled from the model itself) encoded by a diffusers
pipeline's own VAE and text encoder into the shard folders that :mod:`sparsevid.training` reads
(:mod:`.cache`); finding and decoding the videos (:mod:`.videos`); what differs between pipeline families
(:mod:`.families`). Needs diffusers, and PyAV for video files (``pip install sparsevid[data]``)."""
from .cache import CacheReport, Encoder, cache_synthetic, cache_videos, load_encoder
from .families import FAMILIES, Family, family_for
from .videos import Clip, UnusableItem, VideoItem, find_videos, fit, read_clip

__all__ = ["FAMILIES", "CacheReport", "Clip", "Encoder", "Family", "UnusableItem", "VideoItem", "cache_synthetic",
           "cache_videos", "family_for", "find_videos", "fit", "load_encoder", "read_clip"]
