#!/usr/bin/env bash
# Quality of the second-generation built-in model (shipped in lab/sparsevid_lab/assets/) on one GPU, at both
# resolutions:
#   long (32 x 128 x 128, 32,768 tokens): dense caption faithfulness, noise floor, held-out loss, oracle recall,
#       and training-free masks with top-k, top-p and hybrid each calibrated to 90% and 95% sparsity;
#   short (16 x 64 x 64, the CPU demo's clips): dense caption faithfulness beside top-k 25%.
# Usage (repo root, CUDA machine): bash lab/scripts/measure_builtin_gen2.sh OUT
set -uo pipefail
out=$1
model=${MODEL:-lab/sparsevid_lab/assets}
python3 -m sparsevid_lab eval --device cuda --model "$model" --captions 4 --seeds 0 --probe-clips 1 \
    --rules-at 0.9 0.95 --out "$out/long"
python3 -m sparsevid_lab eval --device cuda --model "$model" --clip 16,64,64 --captions 6 --seeds 0 1 \
    --config "rule=topk,topk=0.25" --out "$out/short"
