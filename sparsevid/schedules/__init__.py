"""Which sparsity applies at which layer and denoising step."""
from .config import LayerPlan, SparseConfig

__all__ = ["LayerPlan", "SparseConfig"]
