"""Which sparsity applies at which layer and denoising step, how masks are reused across steps, and the
per-layer runtime that makes each mask decision."""
from .config import MASK_SETTINGS, LayerPlan, MaskSetting, SparseConfig
from .reuse import MaskReuse
from .runtime import LayerRuntime, StepPosition
from .spec import parse_config

__all__ = ["MASK_SETTINGS", "LayerPlan", "LayerRuntime", "MaskReuse", "MaskSetting", "SparseConfig", "StepPosition",
           "parse_config"]
