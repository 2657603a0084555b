"""Tensor-in, tensor-out operations: masks, block-sparse attention backends, mask prediction."""
from .attention import BACKENDS, PRECISIONS, block_sparse_attention
from .mask import DEFAULT_BLOCK_K, DEFAULT_BLOCK_Q, SparseMask, num_blocks, random_block_mask
from .predict import MaskStats, predict_mask
from .refine import select_from_mass
from .settings import PredictSettings
from .tiling import tile_permutation, tile_tokens, untile_tokens

__all__ = ["DEFAULT_BLOCK_K", "DEFAULT_BLOCK_Q",
           "BACKENDS", "PRECISIONS", "SparseMask", "block_sparse_attention", "num_blocks", "random_block_mask",
           "MaskStats",
           "PredictSettings", "predict_mask", "select_from_mass", "tile_permutation", "tile_tokens",
           "untile_tokens"]
