#!/usr/bin/env bash
# One GPU session that checks and times everything, each step bounded so the session fits one call.
# Usage (repo root, CUDA machine): OUT=results bash benchmarks/gpu_session.sh
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-results}
mkdir -p "$OUT"
step() {  # step NAME SECONDS COMMAND...
    local name=$1 seconds=$2; shift 2
    echo "== $name (limit ${seconds}s)"
    timeout "$seconds" "$@" > "$OUT/$name.log" 2>&1
    echo "== $name exit $?"
    grep -vE "^\{|DEBUG" "$OUT/$name.log" | tail -n 25
}
step gpu_tests_attention 75 python3 -m pytest -q -rfE --tb=line -p no:cacheprovider -m gpu tests/test_attention_gpu.py
step gpu_tests_predict 45 python3 -m pytest -q -rfE --tb=line -p no:cacheprovider -m gpu tests/test_predict.py
step bench_attention_1.3b 190 python3 benchmarks/bench_attention.py --out "$OUT/attention" --shapes wan1.3b-480p
step bench_predict 50 python3 benchmarks/bench_predict.py --out "$OUT/predict"
step bench_e2e_1.3b 60 python3 benchmarks/bench_e2e.py --out "$OUT/e2e13" --models wan1.3b
step bench_e2e_14b 100 python3 benchmarks/bench_e2e.py --out "$OUT/e2e14" --models wan14b --iters 2
step bench_attention_14b 40 python3 benchmarks/bench_attention.py --out "$OUT/attention14" --shapes wan14b-720p --sparsities 0.95,0 --check-sparsities ""
