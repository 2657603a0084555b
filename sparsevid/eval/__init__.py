"""Yardsticks against the dense model: attention recall and output error of masks, the oracle recall (the best
any mask with the same tile counts can do), rule settings calibrated to a target sparsity, velocity error and
held-out flow-matching loss of a transformer, and PSNR / SSIM of clips."""
from .calibrate import calibrate_rules, calibrate_topp, check_targets, mean_sparsity
from .metrics import attention_recall, cosine_similarity, relative_l1, sparse_output_error
from .oracle import ORACLE_SPARSITIES, ExactTiles, OracleStudy, oracle_recall, predicted_recall, tiles_for_sparsity
from .velocity import (HELDOUT_SEED, HeldOutSet, heldout_loss, heldout_set, predict_velocities, velocity_error,
                       velocity_tracker)
from .video_metrics import clip_similarity, psnr, ssim

__all__ = ["HELDOUT_SEED", "ORACLE_SPARSITIES", "ExactTiles", "HeldOutSet", "OracleStudy", "attention_recall",
           "calibrate_rules", "calibrate_topp", "check_targets", "clip_similarity", "cosine_similarity", "heldout_loss",
           "heldout_set", "mean_sparsity", "oracle_recall", "predict_velocities", "predicted_recall", "psnr",
           "relative_l1", "sparse_output_error", "ssim", "tiles_for_sparsity", "velocity_error", "velocity_tracker"]
