"""diffusers integration: per-family adapters, the sparse attention processors, the 3D-tile token order, context
parallelism and the one-line apply / remove switch.

diffusers itself is imported only when a processor needs it.
"""
from .adapters import adapter_for
from .context_parallel import head_range
from .loading import load_transformer
from .processors import SDPAInterceptor
from .switch import (apply_sparse_attention, attention_records, attention_stats, dense_attention, denoising_step,
                     forward_stats, is_sparse, pipeline_transformers, remove_sparse_attention, reset_denoising_step,
                     set_attention_measure, set_collect_stats, set_denoising_step)
from .token_order import tile_order

__all__ = ["SDPAInterceptor", "adapter_for", "apply_sparse_attention", "attention_records", "attention_stats",
           "dense_attention", "denoising_step", "forward_stats", "head_range", "is_sparse", "load_transformer",
           "pipeline_transformers", "remove_sparse_attention",
           "reset_denoising_step", "set_attention_measure", "set_collect_stats", "set_denoising_step", "tile_order"]
