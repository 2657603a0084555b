#!/usr/bin/env bash
# The claims grid's distill_hybrid_63 and distill_topk_95 students again, trained through the library's generic
# training path (sparsevid.training.distill on the built-in model's transformer, its caption encoder supplying the
# text states), with the slice grid's calibration, budget and evaluation: OUT/claims_generic/grid.{json,md}.
#   OUT=outputs bash lab/scripts/claims_generic_path.sh
set -u
OUT=${OUT:-outputs}
PYTHON=${PYTHON:-python3}
grid="$OUT/claims_generic"
mkdir -p "$grid"
# the slice grid's calibration
[ -f "$grid/calibration.json" ] || cp lab/results/claims_h200/calibration.json "$grid/" 2>/dev/null
run() {  # run RULE TARGET
    PYTHONUNBUFFERED=1 timeout 290 "$PYTHON" -m sparsevid_lab.studies.claims_grid --out "$grid" --budget-minutes 4.7 \
        --rules "$1" --targets "$2" --objectives distill --part train report
}
run hybrid 0.63
run topk 0.95
"$PYTHON" -m sparsevid_lab.studies.claims_grid --out "$grid" --rules hybrid topk --targets 0.63 0.95 \
    --objectives distill --part report  # both entries in one grid.{json,md}
