"""sparsevid: block-sparse attention for video diffusion transformers."""
from .ops import SparseMask, block_sparse_attention, random_block_mask
from .ops import MaskStats, predict_mask, tile_permutation
from .schedules import SparseConfig
from .models import (apply_sparse_attention, load_sparse_student, attention_stats, denoising_step, forward_stats, is_sparse,
                     remove_sparse_attention, reset_denoising_step, set_collect_stats, set_denoising_step)

__version__ = "0.1.0"

__all__ = ["SparseMask", "block_sparse_attention", "random_block_mask", "__version__",
           "MaskStats", "predict_mask", "tile_permutation",
           "SparseConfig", "apply_sparse_attention", "remove_sparse_attention", "attention_stats", "forward_stats",
           "denoising_step", "is_sparse", "load_sparse_student", "reset_denoising_step", "set_collect_stats", "set_denoising_step"]
