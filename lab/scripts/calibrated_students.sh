#!/usr/bin/env bash
# Issue 35's mask plan of distillation: students of the built-in model (long clip) distilled with the per-head
# calibrated plan (the library's calibrate_heads on the teacher, loaded with sparsevid.SparseConfig.from_calibration,
# allocated for the sparsity global top-k reaches) against students distilled with global top-k, same steps, batch,
# data and evaluation as the claims grid: OUT/calibrated_students/grid.{json,md,png}, the per-head calibration in
# OUT/calibrated_students/heads_calibration.{json,png}. One call trains what fits in 8.5 minutes and resumes the rest;
# the training-free entries (noise floor, per-head and top-k without training) fill the time left.
#   OUT=outputs bash lab/scripts/calibrated_students.sh              # 95%; repeat until grid.md lists nothing missing
#   OUT=outputs bash lab/scripts/calibrated_students.sh 0.95 0.63    # also 63%
set -u
OUT=${OUT:-outputs}
PYTHON=${PYTHON:-python3}
targets=("${@:-0.95}")
PYTHONUNBUFFERED=1 timeout 570 "$PYTHON" -m sparsevid_lab.studies.claims_grid --out "$OUT/calibrated_students" \
    --rules per-head topk --objectives distill --targets "${targets[@]}" --budget-minutes 8.5 \
    --part calibrate train evaluate
