#!/usr/bin/env bash
# GPU checks and benchmarks in bounded parts, each sized to fit a few minutes of one H200. On a machine with
# two GPUs run them side by side, one per GPU (`kernels` with `model`, `tests` with `throughput` or
# `training`); `parallel` needs both.
# Speed benchmarks run through `python -m benchmarks NAME` (benchmarks/registry.py) and write their current
# result to RESULTS/NAME/<gpu>.{json,md,png}; the studies of the built-in model run from the lab
# (`python3 -m sparsevid_lab.studies.NAME`) and write under OUT.
# Usage (repo root, CUDA machine): OUT=DIR bash benchmarks/gpu_session.sh PART [ARGS]
#   (a copy of the tree whose git state is not the commit being measured: set GIT_COMMIT to that commit, which
#   the results record)
#   (env: OUT, the folder of logs and study outputs, by default outside the repository; RESULTS, the folder of
#   the benchmarks' current results, by default benchmarks/results; PYTHON, the interpreter, python3)
#   kernels     benchmarks attention (Wan 1.3B 128x128 fwd and fwd+bwd vs SDPA and FlexAttention) and
#               attention_128x64 (fwd)
#   kernels14b  benchmark attention_14b (Wan 14B 720p forward at 95%, 128x128 and 128x64)
#   tile_mass   benchmark tile_mass (forward with exact tile masses vs plain forward: time, per-kernel
#               breakdown, mass error)
#   model       benchmark training_free (tile-mass overhead, 50-step Wan 1.3B loop); the training-free quality
#               study on the built-in model
#   throughput  benchmarks cache (sparsevid cache clips/s: tiny pipeline, Wan2.1 VAE + umT5-XXL size at 480p) and
#               distill (fine-tuning step, Wan 1.3B 480p: dense vs sparse, diffusion and distill, attention-only and
#               LoRA, checkpointing on and off)
#   throughput_compiled  benchmark distill_compiled (the same step under compile_repeated_blocks)
#   throughput14b  benchmark distill_14b (fine-tuning step, Wan 14B 720p on one GPU, attention-only and LoRA)
#   throughput14b_compiled  benchmark distill_14b_compiled (the diffusion step of throughput14b compiled)
#   predict     benchmark predict (mask prediction: every kernel config, Wan 1.3B and 14B shapes)
#   limits      benchmark predict_limits (kernel device times, pool vs a plain read, TF32 logits, budget)
#   per_head    GPU tests of per-head budgets (no sync, the scalar plan's kernels and no host-to-device copy after the
#               first call, eager and inductor); benchmark predict_per_head (per-head vs scalar top-k 5% plans, Wan
#               1.3B and 14B: predict and predict + forward, eager and compiled; target: at most +2% attention time)
#   per_head_study  the per-head calibration study of the built-in model at its long clip (32,768 tokens), velocity
#               error only: calibrated per-head plans against global top-k at 63%, 90.6% and 95.3% on two held-out
#               sets (issue 35's target: calibrated at 95% no worse than global top-k at 90%; OUT/per_head_study)
#   calibrate   benchmark calibrate_wan13b (per-head calibration of a random-weight Wan 1.3B at 480p, 32,760 tokens:
#               6 dense forwards measured under the 23 default candidates, target 95%; seconds per phase, peak memory,
#               file size, the file loaded back with SparseConfig.from_calibration; issue 35's target: <= 10 min)
#   training    one call of the claims grid on the built-in model (sparsevid_lab.studies.claims_grid; repeat the part
#               until OUT/claims/grid.md lists nothing missing: each call resumes where the last stopped);
#               arguments after the part name go to the grid, e.g. `training --targets 0.95`
#   training_full  one call of the claims grid's other arm: students fine-tuned on the whole distribution (data
#               like pre-training, `--fine-tune-on full`) in OUT/claims_full, calibrated as the slice grid was
#               (lab/results/claims_h200/calibration.json); repeat like `training`, e.g. `training_full
#               --targets 0.95`
#   training_shift  the distilled students of the claims grid (hybrid and top-k, 63% and 95%, on the slice) with their
#               noise levels drawn at time shift 5, the sampler's, instead of the pre-training shift 2: does
#               distilling where the sampler steps lift them? (OUT/claims_shift5, calibrated as the slice grid; repeat
#               like `training`; measured: lab/results/claims_shift5_h200/, +0.2 dB at 95%, none at 63%)
#   training_seeds  the run-to-run noise of the slice grid's distilled hybrid 63% student: trained again with other
#               training-noise and data seeds (seed S, data seed S+1) in OUT/claims_seedS, calibrated as the slice
#               grid; arguments are the seeds (default 1 2), about 4.5 minutes each
#   synthetic   lab/scripts/claims_synthetic.sh cache then train in one call (the distilled hybrid 63% student fine-tuned
#               on the teacher's own samples; env NAME, CLIPS, CACHE_STEPS, CACHE_GUIDANCE as that script takes them, e.g.
#               `NAME=synthetic_unguided CACHE_GUIDANCE=1`; 256 guided clips cache in ~100 s, training ~290 s)
#   calibrated_students  one call of lab/scripts/calibrated_students.sh (OUT/calibrated_students): students of the
#               built-in model distilled with the per-head calibrated mask plan vs global top-k at the same sparsity
#               (95%; arguments are the targets, e.g. `calibrated_students 0.95 0.63`); repeat the part until
#               grid.md lists nothing missing (each call resumes where the last stopped)
#   motion      why the built-in model misses the captioned motion: equal-budget training levers (warm restarts
#               of the shipped model, 100 s each; at most five fit one call, e.g. `motion --levers one_object
#               one_object_high_noise`), by dense faithfulness (the sampler part, measured, is
#               `python3 -m sparsevid_lab.studies.motion_study --part sampler`)
#   demo_student  the demo's sparse student: the shipped model distilled for top-k 0.25 (75%) at the CPU clip
#               (16 x 64 x 64, whole procedural distribution, attention trainable, ~2 min), exported as an asset
#               (OUT/demo_student: copy the student's files to lab/sparsevid_lab/assets/sparse_student/)
#   fp8         the quantized forwards' GPU tests (precision fp8 and int8, one fixed config) and benchmark
#               attention_fp8 (int8 and fp8 vs bf16 sparse on the same masks, Wan 1.3B at 95/90/50%/full and 14B at
#               95%/full: kernel, quantization, public call and prediction + call ms, accuracy)
#   quantized_quality  issue 37's end-to-end bar on the built-in model at its long clip: top-k 95% and 63% at bf16,
#               int8 and fp8, sampled clips (quantized vs bf16 sparse: PSNR >= 30 dB) and held-out velocity error
#               (at most 1.10x bf16 sparse's); OUT/quantized_quality/results.{json,md}; arguments go to the study,
#               e.g. `quantized_quality --captions 4 --replay-masks` (each quantized setting also sampled with the
#               native run's masks replayed: the clip bar without tile flips)
#   quantizer   benchmark quantizer_limits (the int8 K/V quantizer's kernel taken apart: what its time is made of)
#   int8_limits benchmark int8_kernel_limits (the int8 forward's loop taken apart: Q, conversion, promotion, configs;
#               the same forward pipelined by hand in Gluon); arguments go to it, e.g. `int8_limits --variants pairs`
#   ws_int8     benchmark ws_int8_limits (the int8 forward warp-specialised in Gluon against the library's: agreement on
#               odd shapes, Wan 1.3B at 95%/full and 14B at 95%)
#   peers       benchmark attention_peers (SageAttention, FlashInfer's Hopper block-sparse bf16 and Sage FP8,
#               SpargeAttn, flash-attn-4 where they are installed, beside the bf16 and int8 forwards on the same
#               masks; a peer that does not import or run is listed with its error); installs the wheels of .whl/peers
#               first (made by `python scripts/peer_wheels.py --out .whl/peers`) and flash-attn-4's, joined from
#               .whl/fa4 (made by `--flash-attn-4 .whl/fa4`: two folders, carried by two calls on the same machine,
#               as neither fits one carry beside .whl/peers), and uses SpargeAttn where peers_build compiled it;
#               arguments go to the benchmark, e.g. `peers --shapes wan1.3b-480p-64,wan1.3b-480p`
#   flash_attn4 the GPU tests of backend="flash_attn4" and benchmark attention_flash_attn4 (it beside the Triton
#               forwards and cuDNN); flash-attn-4's wheels joined from .whl/fa4 as for `peers` (two calls on one
#               warm machine, each carrying one folder: `python scripts/peer_wheels.py --flash-attn-4 .whl/fa4
#               --folder-mib 56`, then any part carrying .whl/fa4/1 (its copy is kept in PEER_CACHE), then this one
#               carrying .whl/fa4/2); arguments go to the benchmark, e.g. `flash_attn4 --sparsities 0.95`
#   flash_attn4_14b  benchmark attention_flash_attn4_14b (the same at Wan 14B 720p, 95%), flash-attn-4 as above
#   flash_attn4_api  benchmark predict_api_flash_attn4 (prediction + forward through the public API on the Triton
#               kernels and on flash-attn-4 against dense cuDNN, Wan 1.3B and 14B), flash-attn-4 as above
#   e2e13b_flash_attn4  the GPU tests of backend="flash_attn4", then benchmark e2e_13b_flash_attn4 (the whole Wan
#               1.3B transformer at 95% on 128x128 blocks, dense against the Triton kernels and flash-attn-4, eager
#               and compiled); flash-attn-4 as above (its folders carried by earlier calls on the same machine), and
#               diffusers' wheels installed as for the other e2e parts; arguments go to the benchmark, e.g.
#               `e2e13b_flash_attn4 --compile eager`
#   peers_build compile SpargeAttn for sm90 from the sources peer_wheels.py packed (--spargeattn-git) into .peers,
#               which `peers` then uses (a separate call on the same warm machine: the build takes minutes)
#   tests       GPU tests (one fixed config per kernel, no tuning)
#   parallel    (two GPUs) benchmark context_parallel (Wan 14B forward, one vs two GPUs); distillation under DDP
#   ddp         (two GPUs) distillation under DDP alone: one vs two GPUs at the same global batch
#   runtime     GPU tests of the runtime (no host sync in the public calls, the step bookkeeping, inference and
#               checkpointed training forwards, reduce-overhead CUDA graphs); benchmark predict_api (predict + forward
#               through the public API vs the forward alone at the Wan 1.3B shape)
#   compile     the inductor tests in the default mode: every family's tiny sparse transformer compiled matches eager
#               (four pytest workers where pytest-xdist is installed: compiling is host-bound)
#   compile_autotune  the inductor tests in mode max-autotune-no-cudagraphs (minutes per model: it benchmarks
#               GEMM templates for every shape)
#   e2e13b      benchmark e2e_13b_compiled (Wan 1.3B 480p at 95%, dense and sparse, eager and torch.compile)
#   e2e13b_quantized  benchmark e2e_13b_quantized (Wan 1.3B 480p at 95%: dense, bf16 and int8 sparse, eager and
#               torch.compile)
#   e2e13b_modes  benchmark e2e_13b_modes (the same under compile_repeated_blocks with mode reduce-overhead
#               (CUDA graphs) and max-autotune-no-cudagraphs)
#   e2e14b      benchmark e2e_14b (Wan 14B 720p at 95%, dense and sparse, eager)
#   e2e14b_compiled  benchmark e2e_14b_compiled (the same compiled: compile_repeated_blocks, default mode)
#   families    benchmark families (real-size forward, eager, dense vs top-k 5% and hybrid: Wan2.2 TI2V-5B, LTX-Video,
#               SkyReels-V2, CogVideoX-5B; `python -m benchmarks families --estimate` prints the estimated seconds
#               per family); families_large: the same for Wan2.2 A14B, HunyuanVideo 1.5 and Mochi-1 10B;
#               families_extra: LTX-Video 0.9.7 13B, Wan2.1 VACE-14B and HunyuanVideo 13B
#   families_compiled, families_compiled_large, families_compiled_hunyuan, families_compiled_mochi,
#               families_compiled_cogvideox  the same
#               compiled (benchmarks of those names, one GPU call each)
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-${TMPDIR:-/tmp}/sparsevid_gpu_session}
RESULTS=${RESULTS:-benchmarks/results}
PYTHON=${PYTHON:-python3}
PARTS="kernels|fp8|quantizer|int8_limits|ws_int8|quantized_quality|kernels14b|tile_mass|model|throughput|throughput_compiled|throughput14b|throughput14b_compiled|predict|limits|per_head|per_head_study|calibrate|training|training_full|training_shift|training_seeds|synthetic|calibrated_students|motion|\
demo_student|peers|flash_attn4|flash_attn4_14b|flash_attn4_api|e2e13b_flash_attn4|peers_build|tests|parallel|ddp|runtime|compile|compile_autotune|e2e13b|e2e13b_quantized|e2e13b_modes|e2e14b|e2e14b_compiled|\
families|families_large|families_extra|families_compiled|families_compiled_large|families_compiled_hunyuan|families_compiled_mochi|families_compiled_cogvideox"
PART=${1:?usage: gpu_session.sh $PARTS}
shift
mkdir -p "$OUT"
step() {  # step NAME SECONDS COMMAND...
    local name=$1 seconds=$2; shift 2
    echo "== $name (limit ${seconds}s)"
    timeout "$seconds" "$@" > "$OUT/$name.log" 2>&1
    echo "== $name exit $?"
    grep -vE "^\{|DEBUG" "$OUT/$name.log" | tail -n 25
}
bench() {  # bench NAME SECONDS [OPTIONS...]: the registered benchmark NAME, its result under RESULTS
    local name=$1 seconds=$2; shift 2
    step "$name" "$seconds" "$PYTHON" -m benchmarks --results "$RESULTS" "$name" "$@"
}
family_bench() {  # family_bench NAME: a families benchmark; expandable segments keep a freed family's memory reusable
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True bench "$1" 540  # (HunyuanVideo 1.5's dense mask is 24 GiB)
}
# Every call, whatever its part, keeps what it carried of .whl/fa4 (flash-attn-4's wheels cut by
# scripts/peer_wheels.py) in PEER_CACHE, outside the tree: a warm machine keeps it, the next call's copy of the tree
# does not; so two calls can each carry one folder.
PEER_CACHE=${PEER_CACHE:-/tmp/sparsevid_peer_cache}
if ls .whl/fa4/*/*.part* > /dev/null 2>&1; then
    mkdir -p "$PEER_CACHE/fa4" && cp -r .whl/fa4/* "$PEER_CACHE/fa4/"
fi
install_peer_wheels() {  # the wheels of .whl/peers into .peers (pip), and flash-attn-4's, joined from the folders
    # kept in PEER_CACHE and extracted into PEER_CACHE/site; both on the paths
    mkdir -p .peers/bin
    if ls .whl/peers/*.whl > /dev/null 2>&1; then
        "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .peers \
            .whl/peers/*.whl
    fi
    if ls "$PEER_CACHE"/fa4/*/*.part* > /dev/null 2>&1 && [ ! -d "$PEER_CACHE/site/flash_attn" ]; then
        rm -rf /tmp/fa4_wheels
        "$PYTHON" scripts/peer_wheels.py --join "$PEER_CACHE/fa4" --into /tmp/fa4_wheels --unpack "$PEER_CACHE/site" \
            || echo "flash-attn-4: not every folder of .whl/fa4 carried yet"
    fi
    # site.addsitedir runs the .pth files (the CUTLASS DSL puts its package folder on sys.path by one)
    local paths
    paths=$("$PYTHON" -c "import site, sys; before = set(sys.path); site.addsitedir('$PEER_CACHE/site'); \
site.addsitedir('$PWD/.peers'); print(':'.join(p for p in sys.path if p not in before))")
    export PYTHONPATH=$paths:${PYTHONPATH:-} PATH=$PWD/.peers/bin:$PATH
}
flash_attn4_tests() {  # the GPU tests of backend="flash_attn4" (flash-attn-4 on the paths: install_peer_wheels), one
    # fixed config per Triton kernel (autotuning the Triton kernels they compare against took minutes)
    SPARSEVID_AUTOTUNE=off step flash_attn4_tests "${TEST_SECONDS:-200}" "$PYTHON" -m pytest -q -rfE --tb=short \
        -p no:cacheprovider -m gpu --durations=5 tests/test_flash_attn4.py
}
claims_variant() {  # claims_variant NAME MINUTES GRID_ARGS...: a variant of the claims grid in OUT/claims_NAME,
    local name=$1 minutes=$2; shift 2  # calibrated as the slice grid was (its masks do not depend on the students)
    mkdir -p "$OUT/claims_$name"
    [ -f "$OUT/claims_$name/calibration.json" ] || cp lab/results/claims_h200/calibration.json "$OUT/claims_$name/"
    step "claims_grid_$name" "$(( ${minutes%.*} * 60 + 40 ))" "$PYTHON" -m sparsevid_lab.studies.claims_grid \
        --out "$OUT/claims_$name" --budget-minutes "$minutes" --part calibrate evaluate train evaluate "$@"
}
case "$PART" in
kernels)
    bench attention 240
    bench attention_128x64 150
    ;;
kernels14b)
    bench attention_14b 300
    ;;
tile_mass)
    bench tile_mass 120
    ;;
model)
    bench training_free 150
    step training_free_quality 100 "$PYTHON" -m sparsevid_lab.studies.training_free_quality \
        --out "$OUT/training_free_quality"
    ;;
throughput)
    bench cache 120
    bench distill 420
    ;;
throughput_compiled)
    bench distill_compiled 540
    ;;
throughput14b)
    bench distill_14b 580
    ;;
throughput14b_compiled)
    bench distill_14b_compiled 585
    ;;
predict)
    bench predict 240
    ;;
synthetic)
    step synthetic_cache 560 env OUT="$OUT" PYTHON="$PYTHON" bash lab/scripts/claims_synthetic.sh cache
    step synthetic_train 300 env OUT="$OUT" PYTHON="$PYTHON" bash lab/scripts/claims_synthetic.sh train
    ;;
quantizer)
    bench quantizer_limits 150
    ;;
int8_limits)
    bench int8_kernel_limits 300 "$@"
    ;;
ws_int8)
    SPARSEVID_AUTOTUNE=off bench ws_int8_limits 420 "$@"  # the library's fixed config, as the GPU tests run it
    ;;
quantized_quality)
    step quantized_quality 560 "$PYTHON" -m sparsevid_lab.studies.quantized_quality --out "$OUT/quantized_quality" "$@"
    ;;
calibrated_students)
    step calibrated_students 580 env OUT="$OUT" PYTHON="$PYTHON" bash lab/scripts/calibrated_students.sh "$@"
    ;;
motion)
    step motion_train 570 "$PYTHON" -m sparsevid_lab.studies.motion_study --out "$OUT/motion" --part train \
        --seconds 100 "$@"
    ;;
limits)
    bench predict_limits 180
    ;;
per_head)
    SPARSEVID_AUTOTUNE=off step per_head_tests 240 "$PYTHON" -m pytest -v -rfE --tb=short -p no:cacheprovider -m gpu \
        --durations=0 tests/test_calibration_gpu.py
    bench predict_per_head 540
    ;;
per_head_study)
    step per_head_study 570 "$PYTHON" -m sparsevid_lab.studies.per_head_calibration --out "$OUT/per_head_study" \
        --captions 2 --seeds 0 --sparsities 0.63 0.90625 0.953125 --heldout-seeds 2718281 20240601 \
        --metrics velocity "$@"
    ;;
calibrate)
    bench calibrate_wan13b 580
    ;;
training)
    step claims_grid 580 "$PYTHON" -m sparsevid_lab.studies.claims_grid --out "$OUT/claims" --budget-minutes 9 \
        --part calibrate evaluate train evaluate "$@"
    ;;
training_full)
    claims_variant full 9 --fine-tune-on full "$@"
    ;;
training_shift)
    claims_variant shift5 9 --train-shift 5 --rules hybrid topk --objectives distill "$@"
    ;;
training_seeds)
    for s in ${*:-1 2}; do
        claims_variant "seed$s" 4.4 --rules hybrid --targets 0.63 --objectives distill --seed "$s" \
            --data-seed "$(( s + 1 ))"
    done
    ;;
demo_student)
    step demo_student 200 "$PYTHON" -m sparsevid_lab distill --out "$OUT/demo_student" --clip 16,64,64 \
        --config rule=topk,topk=0.25 --trainable attention --batch-size 32 --max-steps 500 --minutes 1.9 --lr 1e-4 \
        --warmup 20 --train-shift 2.0 --log-every 25 --no-progress
    ;;
peers_build)  # SpargeAttn compiled (sm90 only) from .whl/peers/spargeattn-src.tar.gz into .peers, which later
    install_peer_wheels  # calls on the same machine keep (an ignored folder the carry does not replace); env
    # BUILD_SECONDS (560) bounds the build, which a later call on the same machine resumes
    if [ ! -d /tmp/spargeattn/SpargeAttn ]; then  # kept, with its build folder, so that a call after a timeout resumes
        mkdir -p /tmp/spargeattn && tar -xzf .whl/peers/spargeattn-src.tar.gz -C /tmp/spargeattn
        # Its nvcc flag `-Xcompiler -include,cassert` makes gcc 13 under CUDA 13 define std::__terminate twice; the
        # one header that uses assert includes <cassert> itself instead
        sed -i '/-include,cassert/d' /tmp/spargeattn/SpargeAttn/setup.py
        sed -i '1i #include <cassert>' /tmp/spargeattn/SpargeAttn/csrc/numeric_conversion.cuh
    fi
    ln -sf "$(command -v "$PYTHON")" .peers/bin/python  # its setup.py generates kernels with `python`
    step spargeattn_build "${BUILD_SECONDS:-560}" env TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 "$PYTHON" -m pip install \
        --no-build-isolation --no-deps --no-index --target .peers /tmp/spargeattn/SpargeAttn
    ;;
flash_attn4)  # env BENCH_SECONDS (270) and TEST_SECONDS (200) bound the two steps; arguments go to the benchmark
    install_peer_wheels  # flash-attn-4 compiles its kernels at first use (about half a minute per shape)
    bench attention_flash_attn4 "${BENCH_SECONDS:-270}" "$@"
    flash_attn4_tests
    ;;
flash_attn4_14b)
    install_peer_wheels
    bench attention_flash_attn4_14b "${BENCH_SECONDS:-300}" "$@"
    ;;
flash_attn4_api)
    install_peer_wheels
    bench predict_api_flash_attn4 300 "$@"
    ;;
e2e13b_flash_attn4)  # env TEST_SECONDS (200) and BENCH_SECONDS (460) bound the two steps
    install_peer_wheels
    flash_attn4_tests
    bench e2e_13b_flash_attn4 "${BENCH_SECONDS:-460}" "$@"
    ;;
peers)  # the peers' wheels from `python scripts/peer_wheels.py --out .whl/peers`, carried in .whl
    install_peer_wheels  # SpargeAttn is in .peers too, where peers_build compiled it
    bench attention_peers 540 "$@"  # FlashInfer compiles its kernels at first use; arguments go to the benchmark
    ;;
fp8)
    SPARSEVID_AUTOTUNE=off step fp8_tests 200 "$PYTHON" -m pytest -q -rfE --tb=short -p no:cacheprovider -m gpu \
        --durations=5 tests/test_attention_gpu.py -k "fp8 or int8"
    bench attention_fp8 270
    ;;
tests)
    SPARSEVID_AUTOTUNE=off step gpu_tests 300 "$PYTHON" -m pytest -q -rfE --tb=line -p no:cacheprovider -m gpu tests
    ;;
parallel)
    step context_parallel 200 "$PYTHON" -m torch.distributed.run --nproc-per-node 2 \
        -m benchmarks --results "$RESULTS" context_parallel
    step distill_ddp 150 bash lab/scripts/distill_ddp.sh "$OUT/ddp"
    ;;
ddp)
    step distill_ddp 150 bash lab/scripts/distill_ddp.sh "$OUT/ddp"
    ;;
runtime)
    SPARSEVID_AUTOTUNE=off step runtime_tests 150 "$PYTHON" -m pytest -v -rfE --tb=short -p no:cacheprovider -m gpu \
        --durations=0 tests/test_runtime_gpu.py
    bench predict_api 150
    ;;
compile)
    workers=$("$PYTHON" -c "import xdist" 2>/dev/null && echo "-n 4")
    SPARSEVID_AUTOTUNE=off step compile_tests 570 "$PYTHON" -m pytest -v -rfE --tb=short -p no:cacheprovider -m gpu \
        $workers --durations=0 tests/test_integration_compile.py -k "default"
    ;;
compile_autotune)
    SPARSEVID_AUTOTUNE=off step compile_autotune_tests 570 "$PYTHON" -m pytest -v -rfE --tb=short -p no:cacheprovider \
        -m gpu --durations=0 tests/test_integration_compile.py -k "max-autotune"
    ;;
e2e13b)
    bench e2e_13b_compiled 540
    ;;
e2e13b_quantized)
    bench e2e_13b_quantized 580
    ;;
e2e13b_modes)
    bench e2e_13b_modes 540
    ;;
e2e14b)
    bench e2e_14b 540
    ;;
e2e14b_compiled)
    bench e2e_14b_compiled 540
    ;;
families)
    family_bench families
    ;;
families_large)
    family_bench families_large
    ;;
families_extra)
    family_bench families_extra
    ;;
families_compiled)
    family_bench families_compiled
    ;;
families_compiled_large)
    family_bench families_compiled_large
    ;;
families_compiled_hunyuan)
    family_bench families_compiled_hunyuan
    ;;
families_compiled_mochi)
    family_bench families_compiled_mochi
    ;;
families_compiled_cogvideox)
    family_bench families_compiled_cogvideox
    ;;
*)
    echo "unknown part: $PART ($PARTS)" >&2
    exit 2
    ;;
esac
