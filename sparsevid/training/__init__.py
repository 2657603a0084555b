"""Training: the rectified-flow objective, a reusable loop (AdamW, warm-up, EMA, bf16), checkpoints."""
from .checkpoint import (export_builtin, load_training_state, save_safetensors_atomic, save_training_state,
                         write_text_atomic)
from .ema import EMA
from .flow import flow_matching_loss, sample_t, shift_t
from .loop import LoopConfig, TrainResult, learning_rate, train_loop

__all__ = ["EMA", "LoopConfig", "TrainResult", "export_builtin", "flow_matching_loss", "learning_rate",
           "load_training_state",
           "sample_t", "save_safetensors_atomic", "save_training_state", "shift_t", "train_loop",
           "write_text_atomic"]
