"""sparsevid: block-sparse attention for video diffusion transformers."""
from .ops import SparseMask, block_sparse_attention, random_block_mask

__version__ = "0.1.0"

__all__ = ["SparseMask", "block_sparse_attention", "random_block_mask", "__version__"]
