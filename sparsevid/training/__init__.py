"""Training: velocity distillation of sparse students and the diffusion-loss baseline for diffusers video
transformers of flow-matching families (:mod:`.distill`), on latents with their text conditioning
(:mod:`.latents`); the rectified-flow objective, a reusable loop (AdamW, warm-up, EMA, bf16, data parallel),
atomic checkpoints and the student format (:mod:`.student`)."""
from .checkpoint import load_training_state, save_safetensors_atomic, save_training_state, write_text_atomic
from .distill import DistillConfig, Distillation, DistillResult, distill, prepare_distillation
from .distributed import barrier, is_main_process, setup, teardown
from .draws import STREAM_DATA, STREAM_NOISE, STREAM_SHUFFLE, STREAM_TEACHER, EpochOrder, sample_generator, sample_seed
from .ema import EMA
from .flow import flow_matching_loss, noisy, sample_t, shift_t, weighted_squared_error
from .latents import (BucketOrder, LatentBatch, LatentDirectory, ShardWriter, check_indices, write_latent_sample,
                      write_null_text)
from .loop import LoopConfig, TrainResult, learning_rate, train_loop
from .lora import add_lora, lora_targets, merge_lora
from .student import (STUDENT_CONFIG, STUDENT_WEIGHTS, TRAINABLE, base_fingerprint, load_student, read_student,
                      save_student, trainable_names)
from .velocity import DenseTeacher, predict_velocity

__all__ = ["EMA", "STREAM_DATA", "STREAM_NOISE", "STREAM_SHUFFLE", "STREAM_TEACHER", "STUDENT_CONFIG",
           "STUDENT_WEIGHTS", "TRAINABLE", "BucketOrder", "DenseTeacher", "DistillConfig", "DistillResult", "Distillation",
           "EpochOrder", "LatentBatch", "LatentDirectory", "LoopConfig", "ShardWriter", "TrainResult", "add_lora",
           "barrier", "base_fingerprint", "check_indices", "distill", "flow_matching_loss", "is_main_process",
           "learning_rate", "load_student", "load_training_state", "lora_targets", "merge_lora", "noisy",
           "predict_velocity", "prepare_distillation", "read_student", "sample_generator", "sample_seed", "sample_t", "save_safetensors_atomic",
           "save_student", "save_training_state", "setup", "shift_t", "teardown", "train_loop", "trainable_names",
           "weighted_squared_error", "write_latent_sample", "write_null_text", "write_text_atomic"]
