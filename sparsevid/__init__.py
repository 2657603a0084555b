"""sparsevid: block-sparse attention for video diffusion transformers."""
from .ops import (MaskStats, PredictSettings, SparseMask, block_sparse_attention, predict_mask, random_block_mask,
                  tile_permutation)
from .plan import SparseConfig
from .integration import (apply_sparse_attention, attention_stats, dense_attention, denoising_step, forward_stats,
                          is_sparse, remove_sparse_attention, reset_denoising_step, set_collect_stats,
                          set_denoising_step)
from .training.student import load_student

__version__ = "0.1.0"

__all__ = ["SparseMask", "block_sparse_attention", "random_block_mask", "__version__",
           "MaskStats", "PredictSettings", "predict_mask", "tile_permutation",
           "SparseConfig", "apply_sparse_attention", "remove_sparse_attention", "attention_stats", "forward_stats",
           "dense_attention", "denoising_step", "is_sparse", "load_student", "reset_denoising_step",
           "set_collect_stats", "set_denoising_step"]
