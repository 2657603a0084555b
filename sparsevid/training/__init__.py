"""Training: the rectified-flow objective, a reusable loop (AdamW, warm-up, EMA, bf16, data parallel),
checkpoints, and trainable sparse attention by velocity distillation (:mod:`.distill`)."""
from .checkpoint import (export_builtin, load_training_state, save_safetensors_atomic, save_training_state,
                         write_text_atomic)
from .ema import EMA
from .flow import flow_matching_loss, sample_t, shift_t
from .loop import LoopConfig, TrainResult, learning_rate, train_loop
from .clipfiles import read_clip, write_clip
from .distill import DistillConfig, DistillResult, distill, distillation_loss, save_student
from .sources import DirectorySource, ProceduralSource
from .student_asset import export_sparse_student, save_sparse_student
from .teacher_cache import teacher_cache

__all__ = ["EMA", "LoopConfig", "TrainResult", "export_builtin", "flow_matching_loss", "learning_rate",
           "load_training_state",
           "sample_t", "save_safetensors_atomic", "save_training_state", "shift_t", "train_loop",
           "write_text_atomic",
           "export_sparse_student", "save_sparse_student",
           "DirectorySource", "DistillConfig", "DistillResult", "ProceduralSource", "distill", "distillation_loss",
           "read_clip", "save_student", "teacher_cache", "write_clip"]
