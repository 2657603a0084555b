#!/usr/bin/env bash
# Reproduces the shipped built-in model (lab/sparsevid_lab/assets/builtin.*): 8 minutes of rectified-flow
# training on one H200 (2,015 steps of 64 procedural clips, ~0.24 s per step, bf16 autocast, dense attention).
# Then copy OUT/builtin.safetensors and OUT/builtin.json into lab/sparsevid_lab/assets/.
set -euo pipefail
OUT=${1:-outputs/train_builtin}
PYTHON=${PYTHON:-python3}
PYTHONUNBUFFERED=1 "$PYTHON" -m sparsevid_lab train --out "$OUT" --minutes 8 --batch-size 64 --lr 5e-4 --warmup 200 \
    --ema 0.998 --state /tmp/state.safetensors --log-every 50 --checkpoint-every 1000
