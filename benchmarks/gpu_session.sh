#!/usr/bin/env bash
# GPU checks and benchmarks in bounded parts, each sized to fit one ten-minute call on one H200 (on a
# machine with two GPUs, run `kernels` and `model` side by side, one per GPU, then `training` and `parallel`).
# Usage (repo root, CUDA machine): OUT=results bash benchmarks/gpu_session.sh PART
#   kernels   GPU tests of the op, tile masses and mask prediction (one fixed config per kernel, no tuning);
#             kernel benchmark, Wan 1.3B 128x128 fwd+bwd, with and without tensor-descriptor loads
#   model     training-free benchmark (tile-mass overhead, 50-step Wan 1.3B loop); distillation step
#             throughput (Wan 1.3B); mask-prediction benchmark
#   training  distillation ablation on the built-in model
#   parallel  (two GPUs) distillation under DDP, one vs two GPUs; context-parallel Wan 14B forward
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-results}
PART=${1:?usage: gpu_session.sh kernels|model|training|parallel}
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
    SPARSEVID_AUTOTUNE=off step gpu_tests_ops 150 python3 -m pytest -q -rfE --tb=line -p no:cacheprovider -m gpu \
        tests/test_attention_gpu.py tests/test_predict.py tests/test_tile_mass_gpu.py
    step bench_attention 400 python3 benchmarks/bench_attention.py --out "$OUT/attention" \
        --shapes wan1.3b-480p --blocks 128x128 --tma "all/none"
    ;;
model)
    step bench_training_free 280 python3 benchmarks/bench_training_free.py --out "$OUT/training_free" \
        --settings dense,training-free
    step bench_distill 150 python3 benchmarks/bench_distill.py --out "$OUT/distill" --iters 3
    step bench_predict 90 python3 benchmarks/bench_predict.py --out "$OUT/predict"
    ;;
training)
    export PYTHON=python3 PARALLEL=1
    step distill_ablation 420 bash benchmarks/distill_ablation.sh "$OUT/ablation"
    ;;
parallel)
    step distill_ddp 150 bash benchmarks/distill_ddp.sh "$OUT/ddp"
    step bench_context_parallel 300 python3 -m torch.distributed.run --nproc-per-node 2 \
        benchmarks/bench_context_parallel.py \
        --out "$OUT/context_parallel"
    ;;
*)
    echo "unknown part: $PART (kernels|model|training|parallel)" >&2
    exit 2
    ;;
esac
