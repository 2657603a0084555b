"""Which sparsity applies at which layer and denoising step, and how masks are reused across steps."""
from .config import LayerPlan, SparseConfig
from .reuse import MaskReuse

__all__ = ["LayerPlan", "MaskReuse", "SparseConfig"]
