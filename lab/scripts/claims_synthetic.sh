#!/usr/bin/env bash
# The claims grid's distilled hybrid student at the Wan-equivalent point (63%) fine-tuned on the teacher's own samples:
# `--part cache` samples the teacher densely for the captions of the slice arm's fine-tuning clips into a latent shard
# folder with sparsevid.data.cache_synthetic (the library's `sparsevid cache --synthetic`, here with the built-in
# model as its pipeline), then the student trains on that folder through sparsevid.training.distill, with the slice
# grid's calibration, budget and evaluation: OUT/claims_synthetic/grid.{json,md}.
#   OUT=outputs bash lab/scripts/claims_synthetic.sh cache   # resumable: repeat until every clip is cached
#   OUT=outputs bash lab/scripts/claims_synthetic.sh train
# The teacher samples come from the evaluation's sampler (10 steps, guidance 4) unless CACHE_STEPS / CACHE_GUIDANCE
# say otherwise; NAME (default "synthetic") names the grid folder OUT/claims_NAME, one per sampling variant, e.g.
#   NAME=synthetic_unguided CACHE_GUIDANCE=1 OUT=outputs bash lab/scripts/claims_synthetic.sh cache
set -u
PART=${1:?usage: claims_synthetic.sh cache|train}
OUT=${OUT:-outputs}
PYTHON=${PYTHON:-python3}
CLIPS=${CLIPS:-256}
grid="$OUT/claims_${NAME:-synthetic}"
mkdir -p "$grid"
[ -f "$grid/calibration.json" ] || cp lab/results/claims_h200/calibration.json "$grid/"
common=(--out "$grid" --fine-tune-on synthetic --clips "$CLIPS" --rules hybrid --targets 0.63 --objectives distill
        ${CACHE_STEPS:+--cache-steps "$CACHE_STEPS"} ${CACHE_GUIDANCE:+--cache-guidance "$CACHE_GUIDANCE"})
case "$PART" in
cache) PYTHONUNBUFFERED=1 timeout 550 "$PYTHON" -m sparsevid_lab.studies.claims_grid "${common[@]}" --part cache ;;
train) PYTHONUNBUFFERED=1 timeout 290 "$PYTHON" -m sparsevid_lab.studies.claims_grid "${common[@]}" \
           --budget-minutes 4.7 --part train report ;;
*) echo "unknown part: $PART" >&2; exit 2 ;;
esac
