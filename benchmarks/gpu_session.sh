#!/usr/bin/env bash
# GPU checks and benchmarks in bounded parts, each sized to fit one ten-minute call on one H200. On a machine
# with two GPUs: `kernels` and `model` side by side (one per GPU), then `training` and `tests` side by side,
# then `parallel` on both.
# Usage (repo root, CUDA machine): OUT=results bash benchmarks/gpu_session.sh PART
#   kernels   kernel benchmark, Wan 1.3B 128x128 fwd+bwd, with and without tensor-descriptor loads;
#             training-free quality on the built-in model
#   model     training-free benchmark (tile-mass overhead, 50-step Wan 1.3B loop); distillation step
#             throughput (Wan 1.3B); mask-prediction benchmark
#   training  distillation ablation on the built-in model
#   tests     GPU tests of the op, tile masses and mask prediction (one fixed config per kernel, no tuning)
#   parallel  (two GPUs) distillation under DDP, one vs two GPUs; context-parallel Wan 14B forward
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-results}
PART=${1:?usage: gpu_session.sh kernels|model|training|tests|parallel}
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
    step bench_attention 320 python3 benchmarks/bench_attention.py --out "$OUT/attention" \
        --shapes wan1.3b-480p --blocks 128x128 --sparsities 0,0.9,0.95,0.97 --tma "all/none"
    step bench_attention_more 70 python3 benchmarks/bench_attention.py --out "$OUT/attention_more" \
        --shapes wan1.3b-480p --blocks 128x128 --sparsities 0.5,0.8 --check-sparsities ""
    step training_free_quality 140 python3 benchmarks/training_free_quality.py --out "$OUT/training_free_quality"
    ;;
model)
    step bench_training_free 270 python3 benchmarks/bench_training_free.py --out "$OUT/training_free" \
        --settings dense,training-free
    step bench_distill 140 python3 benchmarks/bench_distill.py --out "$OUT/distill" --iters 3
    step bench_predict 110 python3 benchmarks/bench_predict.py --out "$OUT/predict" --recall-grid none
    ;;
training)
    export PYTHON=python3 PARALLEL=1
    step distill_ablation 420 bash benchmarks/distill_ablation.sh "$OUT/ablation"
    ;;
tests)
    SPARSEVID_AUTOTUNE=off step gpu_tests 400 python3 -m pytest -q -rfE --tb=line -p no:cacheprovider -m gpu tests
    ;;
parallel)
    step distill_ddp 150 bash benchmarks/distill_ddp.sh "$OUT/ddp"
    step bench_context_parallel 300 python3 -m torch.distributed.run --nproc-per-node 2 \
        benchmarks/bench_context_parallel.py --out "$OUT/context_parallel"
    ;;
*)
    echo "unknown part: $PART (kernels|model|training|tests|parallel)" >&2
    exit 2
    ;;
esac
