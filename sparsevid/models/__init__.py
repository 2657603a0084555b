"""diffusers integration: sparse attention processors and the one-line apply / remove switch.

diffusers itself is imported only when a processor needs it.
"""
from .builtin import BuiltinVideoDiT, load_builtin
from .context_parallel import head_range
from .sparse_student import load_sparse_student
from .integration import (apply_sparse_attention, attention_stats, denoising_step, forward_stats, is_sparse,
                          remove_sparse_attention, reset_denoising_step, set_collect_stats, set_denoising_step)

__all__ = ["BuiltinVideoDiT", "load_builtin", "load_sparse_student", "head_range",
           "apply_sparse_attention", "attention_stats", "denoising_step", "forward_stats", "is_sparse",
           "remove_sparse_attention", "reset_denoising_step", "set_collect_stats", "set_denoising_step"]
