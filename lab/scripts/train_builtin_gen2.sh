#!/usr/bin/env bash
# The second-generation built-in model, trained in resumable chunks (one GPU each, a warm restart from the
# weights the last chunk committed). Usage: bash lab/scripts/train_builtin_gen2.sh CHUNK OUT
#   chunk 1: from the first-generation weights (GEN1: a folder with the builtin.* that sparsevid/assets/ held
#            at commit fa556b2, e.g. from `git show fa556b2:sparsevid/assets/builtin.safetensors`), textured
#            panning backgrounds, short clips then long clips.
#   chunk 2: from chunk 1's committed weights, long clips, then mixed resolutions (long and short clips
#            alternating, one step each) so that one set of weights serves both.
#   chunk 3: from the shipped weights (lab/sparsevid_lab/assets/), mixed resolutions with noise levels drawn at
#            time shift 5 (the motion study's best lever for motion, lab/results/motion_h200/), in ROUNDS
#            rounds of ROUND_MINUTES (default 3 x 2.2; each a warm restart from the last), each round's
#            weights measured by dense faithfulness at the short clip (motion_study --part sampler, own sampler):
#            does motion grow with training time? Writes OUT/round<i>/ (weights, log, motion_sampler.md) and
#            OUT/rounds.md (every round's table).
#   chunk 4: chunk 3's rounds with the shipped model first deepened to LAYERS blocks (default 12; each block
#            followed by a copy that starts silent, `sparsevid_lab train --grow-to-layers`): does capacity let
#            the model learn motion at the same budget? (Measured, 3 rounds: no; lab/results/builtin_gen2_h200/
#            chunk4/. A 12-block round takes about 190 s of a GPU call with its measurement.)
#   Later chunks continue the same way from the shipped weights (lab/sparsevid_lab/assets/).
# Each chunk trains for at most 7.5 minutes: chunk 1 (7.5 min of training) took 558 s of one 10-minute GPU
# call with its sampling and measurement; chunk 2 leaves the measurement to a later call
# (python3 -m sparsevid_lab.studies.builtin_study --out DIR).
# Each chunk writes OUT/<phase>/ (weights, config with every phase so far, loss curve, samples, log);
# chunk 1 also OUT/oracle.json (oracle recall of the result on short and long clips). Commit
# OUT/<last phase>/builtin.* to lab/sparsevid_lab/assets/ to continue from there (new weights void the shipped
# students in lab/sparsevid_lab/assets/sparse_student*/: they are fine-tuned from one set of weights, checked by
# hash).
set -euo pipefail
chunk=$1; out=$2
texture=(--background-texture 0.7 --pan 0.5)
case "$chunk" in
  1)
    python3 -m sparsevid_lab train --out "$out/short" --init "${GEN1:?GEN1: the first-generation weights}" --clip 16,64,64 "${texture[@]}" \
        --minutes 3.5 --batch-size 64 --lr 3e-4 --warmup 100 --ema 0.998 --log-every 100 --checkpoint-every 100000
    python3 -m sparsevid_lab train --out "$out/long" --init "$out/short" --clip 32,128,128 "${texture[@]}" \
        --minutes 4 --batch-size 8 --lr 2e-4 --warmup 50 --ema 0.995 --log-every 50 --checkpoint-every 100000
    python3 -m sparsevid_lab.studies.builtin_study --out "$out" --model "$out/long"
    ;;
  2)
    python3 -m sparsevid_lab train --out "$out/long" --init lab/sparsevid_lab/assets --clip 32,128,128 "${texture[@]}" \
        --minutes 4 --batch-size 8 --lr 2e-4 --warmup 50 --ema 0.995 --log-every 50 --checkpoint-every 100000
    python3 -m sparsevid_lab train --out "$out/mixed" --init "$out/long" "${texture[@]}" \
        --clip 32,128,128 --clip 16,64,64 --batch-size 8 --batch-size 64 --clip-weight 1 --clip-weight 1 \
        --minutes 3 --lr 1e-4 --warmup 50 --ema 0.995 --log-every 50 --checkpoint-every 100000
    ;;
  3|4)
    init=lab/sparsevid_lab/assets
    grow=()
    [ "$chunk" = 4 ] && grow=(--grow-to-layers "${LAYERS:-12}")
    for round in $(seq 1 "${ROUNDS:-3}"); do
        python3 -m sparsevid_lab train --out "$out/round$round" --init "$init" "${grow[@]}" "${texture[@]}" \
            --train-shift 5 --clip 32,128,128 --clip 16,64,64 --batch-size 8 --batch-size 64 --clip-weight 1 \
            --clip-weight 1 --minutes "${ROUND_MINUTES:-2.2}" --lr 1e-4 --warmup 50 --ema 0.995 --log-every 100 \
            --checkpoint-every 100000
        python3 -m sparsevid_lab.studies.motion_study --out "$out/round$round" --part sampler --limit 1 --model "$out/round$round"
        init="$out/round$round"
        grow=()
    done
    for round in $(seq 1 "${ROUNDS:-3}"); do  # one summary: each round's faithfulness table
        echo "## round $round ($(grep -o 'trained to step [0-9]* in [0-9]*s' "$out/round$round/train_log.txt"))"
        cat "$out/round$round/motion_sampler.md"
    done > "$out/rounds.md"
    ;;
  *) echo "unknown chunk $chunk" >&2; exit 2 ;;
esac
