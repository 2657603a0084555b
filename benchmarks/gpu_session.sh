#!/usr/bin/env bash
# GPU checks and benchmarks in bounded parts, each sized to fit one ten-minute call on one H200.
# Usage (repo root, CUDA machine): OUT=results bash benchmarks/gpu_session.sh kernels|model|training
#   kernels   GPU tests of the op and mask prediction; kernel benchmark (Wan 1.3B fwd+bwd, Wan 14B fwd)
#   model     mask-prediction benchmark; Wan 1.3B / 14B transformer forward; training-free benchmark
#   training  distillation step throughput (Wan 1.3B); distillation ablation on the built-in model
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-results}
PART=${1:?usage: gpu_session.sh kernels|model|training}
mkdir -p "$OUT"
step() {  # step NAME SECONDS COMMAND...
    local name=$1 seconds=$2; shift 2
    echo "== $name (limit ${seconds}s)"
    timeout "$seconds" "$@" > "$OUT/$name.log" 2>&1
    echo "== $name exit $?"
    grep -vE "^\{|DEBUG" "$OUT/$name.log" | tail -n 25
}
case "$PART" in
kernels)
    step gpu_tests_ops 150 python3 -m pytest -q -rfE --tb=line -p no:cacheprovider -m gpu \
        tests/test_attention_gpu.py tests/test_predict.py tests/test_tile_mass_gpu.py
    step bench_attention_1.3b 330 python3 benchmarks/bench_attention.py --out "$OUT/attention" --shapes wan1.3b-480p
    step bench_attention_14b 80 python3 benchmarks/bench_attention.py --out "$OUT/attention14" \
        --shapes wan14b-720p --sparsities 0.95,0.9,0 --check-sparsities ""
    ;;
model)
    step bench_predict 60 python3 benchmarks/bench_predict.py --out "$OUT/predict"
    step bench_e2e_1.3b 70 python3 benchmarks/bench_e2e.py --out "$OUT/e2e13" --models wan1.3b
    step bench_e2e_14b 200 python3 benchmarks/bench_e2e.py --out "$OUT/e2e14" --models wan14b --iters 2
    step bench_training_free 230 python3 benchmarks/bench_training_free.py --out "$OUT/training_free"
    ;;
training)
    step bench_distill 200 python3 benchmarks/bench_distill.py --out "$OUT/distill"
    export PYTHON=python3
    step distill_ablation 360 bash benchmarks/distill_ablation.sh "$OUT/ablation"
    ;;
*)
    echo "unknown part: $PART (kernels|model|training)" >&2
    exit 2
    ;;
esac
