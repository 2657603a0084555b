#!/usr/bin/env bash
# Data-parallel distillation check: the same run (built-in model, hybrid student with top-k 5% and top-p 0.9,
# procedural data, same global batch) on one GPU and on two GPUs under torchrun; compares the loss
# trajectories and throughput.
# Usage: lab/scripts/distill_ddp.sh [OUT]   (env: PYTHON, STEPS, BATCH, GPUS; needs GPUS CUDA devices)
# CPU smoke run (gloo): GPUS=2 STEPS=2 BATCH=2 DEVICE=cpu MODEL_ARGS=--tiny PYTHON=.venv/bin/python \
#     lab/scripts/distill_ddp.sh /tmp/ddp
set -euo pipefail
OUT=${1:-${TMPDIR:-/tmp}/sparsevid_distill_ddp}  # per-step logs: keep them out of the repository
PYTHON=${PYTHON:-python3}
STEPS=${STEPS:-60}
BATCH=${BATCH:-64}
GPUS=${GPUS:-2}
DEVICE=${DEVICE:-cuda}
MODEL_ARGS=${MODEL_ARGS:-}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
for procs in 1 "$GPUS"; do
    "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$procs" -m sparsevid_lab distill \
        --out "$OUT/procs$procs" --objective distill --config "rule=hybrid,topk=0.05,topp=0.9" --data procedural \
        --data-seed 1 --batch-size "$BATCH" --max-steps "$STEPS" --warmup 10 --log-every 10 \
        --checkpoint-every 1000 --no-progress --device "$DEVICE" $MODEL_ARGS
    # The check reads log.jsonl and student.json only: drop the weights so the output stays small.
    rm -f "$OUT/procs$procs"/*.safetensors
done
"$PYTHON" -m sparsevid_lab.studies.compare_ddp "$OUT/procs1" "$OUT/procs$GPUS" --out "$OUT"
