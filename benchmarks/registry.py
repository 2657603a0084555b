"""Every benchmark by name: the module that runs it, what it measures (one line) and the options of the module
that make its published configuration. ``python -m benchmarks NAME`` runs one and writes its current result to
``benchmarks/results/NAME/<gpu>.{json,md,png}``; options given after NAME are added to (and override) these."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True)
class Benchmark:
    module: str
    description: str
    args: tuple[str, ...] = ()


BENCHMARKS = {
    "attention": Benchmark(
        "benchmarks.bench_attention",
        "Wan 1.3B attention, 128x128 blocks, 0-97% sparse: Triton vs cuDNN/flash SDPA and FlexAttention, fwd, fwd+bwd",
        ("--shapes", "wan1.3b-480p", "--blocks", "128x128", "--sparsities", "0,0.9,0.95,0.97,0.5,0.8")),
    "attention_128x64": Benchmark(
        "benchmarks.bench_attention",
        "Wan 1.3B attention forward, 128x64 blocks, 90-97% sparse, against the same baselines",
        ("--shapes", "wan1.3b-480p", "--blocks", "128x64", "--sparsities", "0.9,0.95,0.97",
         "--backward-shapes", "none")),
    "attention_14b": Benchmark(
        "benchmarks.bench_attention",
        "Wan 14B 720p attention forward at 95%, 128x128 and 128x64 blocks, against the same baselines",
        ("--shapes", "wan14b-720p", "--blocks", "128x128,128x64", "--sparsities", "0.95",
         "--backward-shapes", "none")),
    "attention_fp8": Benchmark(
        "benchmarks.bench_attention_fp8",
        "int8 and fp8 vs bf16 block-sparse forward, 128x64, Wan 1.3B at 95/90/50%/full and 14B at 95%/full: ms "
        "(kernel, quantization, public call, with prediction), accuracy",
        ("--shapes", "wan1.3b-480p,wan14b-720p", "--sparsities", "0.95,0.9,0.5,0/0.95,0")),
    "quantizer_limits": Benchmark(
        "benchmarks.quantizer_limits",
        "the int8 K/V quantizer taken apart at Wan 1.3B: its kernel's K and V parts, V's transposed store, warps, "
        "division vs reciprocal, keys per program, against a bf16 copy of K and V"),
    "int8_kernel_limits": Benchmark(
        "benchmarks.int8_kernel_limits",
        "the int8 forward's loop taken apart at Wan 1.3B, 95%: Q quantized before or in the kernel, the logits' "
        "conversion, the promotion of P V, configs; errors against the bf16 kernel at 95% and with the full mask"),
    "ws_int8_limits": Benchmark(
        "benchmarks.ws_int8_limits",
        "the int8 forward warp-specialised in Gluon (a producer warp, two consumer warp groups sharing K/V tiles) "
        "against the library's Triton int8 forward: agreement on odd shapes, Wan 1.3B at 95%/full and 14B at 95%"),
    "attention_peers": Benchmark(
        "benchmarks.bench_attention_peers",
        "quantized and block-sparse peers (SageAttention, FlashInfer's Hopper block-sparse bf16 and Sage FP8, "
        "SpargeAttn, flash-attn-4) beside sparsevid's bf16 and int8 forwards on the same masks, Wan 1.3B padded to "
        "32,768 tokens at 95/90%, 128x64 and 64x128 tiles: what ran, ms, accuracy, why the others did not"),
    "attention_flash_attn4": Benchmark(
        "benchmarks.bench_attention_peers",
        "sparsevid's backend='flash_attn4' (flash-attn-4's block-sparse forward and backward on sparsevid's tables) "
        "beside its Triton bf16 and int8 forwards and cuDNN, Wan 1.3B at 32,760 tokens and padded to 32,768, 95/90%, "
        "128x64 and 128x128 tiles; forward + backward too (flash-attn-4's on 128x128)",
        ("--peers", "flash-attn-4", "--shapes", "wan1.3b-480p-64,wan1.3b-480p", "--blocks", "128x64,128x128",
         "--backward")),
    "attention_flash_attn4_14b": Benchmark(
        "benchmarks.bench_attention_peers",
        "the same at Wan 14B 720p (75,600 tokens), 95%",
        ("--peers", "flash-attn-4", "--shapes", "wan14b-720p", "--sparsities", "0.95", "--blocks", "128x64,128x128",
         "--backward")),
    "attention_cpu": Benchmark(
        "benchmarks.bench_attention_cpu",
        "CPU attention at the built-in demo's shape: the gather backend vs dense SDPA and the reference backend"),
    "tile_mass": Benchmark(
        "benchmarks.bench_training_free",
        "Wan 1.3B attention forward with exact tile masses vs the plain forward (overhead, mass error)",
        ("--parts", "kernel")),
    "training_free": Benchmark(
        "benchmarks.bench_training_free",
        "training-free mode: tile-mass overhead and a 50-step Wan 1.3B loop, dense vs the training-free schedule",
        ("--settings", "dense,training-free", "--cfg-passes", "1")),
    "predict": Benchmark(
        "benchmarks.bench_predict",
        "mask prediction at the Wan 1.3B and 14B shapes: every kernel config per stage, end to end, vs PyTorch",
        ("--recall-grid", "none")),
    "predict_api": Benchmark(
        "benchmarks.bench_predict",
        "predict_mask + block_sparse_attention through the public API vs the forward alone (Wan 1.3B shape)",
        ("--parts", "api", "--shapes", "wan1.3b", "--recall-grid", "none")),
    "predict_api_flash_attn4": Benchmark(
        "benchmarks.bench_predict",
        "predict_mask (top-k 5%) + block_sparse_attention through the public API on the Triton kernels and on "
        "flash-attn-4 (installed), against dense cuDNN; Wan 1.3B and 14B, 128x128 blocks",
        ("--parts", "api", "--shapes", "wan1.3b,wan14b", "--recall-grid", "none", "--blocks", "128x128",
         "--api-rules", "topk", "--api-backends", "triton,flash_attn4")),
    "predict_per_head": Benchmark(
        "benchmarks.bench_predict_per_head",
        "per-head vs scalar top-k 5% plans, Wan 1.3B and 14B: predict and predict + forward, eager and compiled"),
    "calibrate_wan13b": Benchmark(
        "benchmarks.bench_calibrate",
        "per-head calibration of a random-weight Wan 1.3B at 480p (6 inputs, target 95%): seconds per phase, peak "
        "memory, file size, the result loaded"),
    "predict_limits": Benchmark(
        "benchmarks.predict_limits",
        "what bounds mask prediction: kernel device times, pool vs a plain read, TF32 logits, the targets' budget"),
    "e2e": Benchmark(
        "benchmarks.bench_e2e",
        "Wan 1.3B and 14B transformer forward, eager, dense (cuDNN SDPA) vs 90% and 95% sparse, per-layer breakdown"),
    "e2e_13b_compiled": Benchmark(
        "benchmarks.bench_e2e",
        "Wan 1.3B forward at 95%, eager and torch.compile (default mode), dense against sparse",
        ("--models", "wan1.3b", "--sparsity", "0.95", "--compile", "eager,default")),
    "e2e_13b_modes": Benchmark(
        "benchmarks.bench_e2e",
        "Wan 1.3B forward at 95% under compile_repeated_blocks, modes reduce-overhead and max-autotune-no-cudagraphs",
        ("--models", "wan1.3b", "--sparsity", "0.95", "--compile", "reduce-overhead,max-autotune-no-cudagraphs",
         "--compile-scope", "blocks")),
    "e2e_13b_quantized": Benchmark(
        "benchmarks.bench_e2e",
        "Wan 1.3B forward at 95%, eager and torch.compile (default mode): dense against bf16 and int8 sparse",
        ("--models", "wan1.3b", "--sparsity", "0.95", "--compile", "eager,default", "--precision", "native,int8")),
    "e2e_13b_flash_attn4": Benchmark(
        "benchmarks.bench_e2e",
        "Wan 1.3B forward at 95% on 128x128 blocks, eager and torch.compile (default mode): dense against sparse on "
        "the Triton kernels and on flash-attn-4 (installed)",
        ("--models", "wan1.3b", "--sparsity", "0.95", "--block-k", "128", "--compile", "eager,default", "--backend",
         "triton,flash_attn4")),
    "e2e_14b": Benchmark(
        "benchmarks.bench_e2e",
        "Wan 14B 720p forward at 95%, eager, dense against sparse",
        ("--models", "wan14b", "--sparsity", "0.95", "--compile", "eager", "--iters", "2")),
    "e2e_14b_compiled": Benchmark(
        "benchmarks.bench_e2e",
        "Wan 14B 720p forward at 95%, compile_repeated_blocks (default mode), dense against sparse",
        ("--models", "wan14b", "--sparsity", "0.95", "--compile", "default", "--compile-scope", "blocks",
         "--iters", "2")),
    "distill": Benchmark(
        "benchmarks.bench_distill",
        "fine-tuning step, Wan 1.3B 480p: dense vs sparse 95%, diffusion and distill, attention/LoRA, ckpt on/off",
        ("--model", "wan1.3b", "--iters", "3")),
    "distill_compiled": Benchmark(
        "benchmarks.bench_distill",
        "fine-tuning step, Wan 1.3B 480p, compile_repeated_blocks: dense vs sparse 95%, checkpointing on",
        ("--model", "wan1.3b", "--trainable", "attention", "--checkpointing", "on", "--compile", "inductor",
         "--warmup", "2", "--iters", "3")),
    "distill_14b": Benchmark(
        "benchmarks.bench_distill",
        "fine-tuning step, Wan 14B 720p on one GPU: dense vs sparse 95%, attention-only and LoRA, checkpointing on",
        ("--model", "wan14b", "--checkpointing", "on", "--warmup", "1", "--iters", "1")),
    "distill_14b_compiled": Benchmark(
        "benchmarks.bench_distill",
        "fine-tuning step, Wan 14B 720p on one GPU, compile_repeated_blocks: dense vs sparse 95%, attention-only and "
        "LoRA, checkpointing on",
        ("--model", "wan14b", "--objectives", "diffusion", "--checkpointing", "on", "--compile", "inductor",
         "--warmup", "1", "--iters", "1")),
    "cache": Benchmark(
        "benchmarks.bench_cache",
        "sparsevid cache throughput (clips/s): the tiny test pipeline, and Wan2.1's VAE with umT5-XXL's size, 480p"),
    "context_parallel": Benchmark(
        "benchmarks.bench_context_parallel",
        "Wan 14B forward over the ranks of torchrun (Ulysses) vs one GPU, dense and 95% sparse, with a check"),
    "families": Benchmark(
        "benchmarks.bench_families",
        "real-size forward, eager, dense vs top-k 5% and hybrid: Wan2.2 TI2V-5B, LTX, SkyReels, CogVideoX",
        ("--families", "wan22_ti2v,ltx,skyreels_v2,cogvideox", "--compile", "eager", "--iters", "2")),
    "families_large": Benchmark(
        "benchmarks.bench_families",
        "real-size forward, eager, dense vs top-k 5% and hybrid: Wan2.2 A14B (one expert) 720p, HunyuanVideo 1.5 720p, "
        "Mochi-1 10B 480p",
        ("--families", "wan22_a14b,hunyuan_video15,mochi", "--compile", "eager", "--iters", "2")),
    "families_extra": Benchmark(
        "benchmarks.bench_families",
        "real-size forward, eager, dense vs top-k 5% and hybrid: LTX-Video 0.9.7 13B (1536x1024), Wan2.1 VACE-14B 720p, "
        "HunyuanVideo 13B 720p",
        ("--families", "ltx_13b,wan_vace,hunyuan_video", "--compile", "eager", "--iters", "2")),
    "families_compiled": Benchmark(
        "benchmarks.bench_families",
        "the families benchmark compiled (compile_repeated_blocks, default mode): Wan2.2 TI2V-5B, LTX, SkyReels-V2",
        ("--families", "wan22_ti2v,ltx,skyreels_v2", "--compile", "default", "--iters", "2")),
    "families_compiled_large": Benchmark(
        "benchmarks.bench_families",
        "the families benchmark compiled (compile_repeated_blocks, default mode): Wan2.2 A14B, HunyuanVideo 1.5",
        ("--families", "wan22_a14b,hunyuan_video15", "--compile", "default", "--iters", "2")),
    "families_compiled_hunyuan": Benchmark(
        "benchmarks.bench_families",
        "the families benchmark compiled (compile_repeated_blocks, default mode): HunyuanVideo 13B 720p",
        ("--families", "hunyuan_video", "--compile", "default", "--iters", "2")),
    "families_compiled_mochi": Benchmark(
        "benchmarks.bench_families",
        "the families benchmark compiled (compile_repeated_blocks, default mode): Mochi-1 10B 480p",
        ("--families", "mochi", "--compile", "default", "--iters", "2")),
    "families_compiled_cogvideox": Benchmark(
        "benchmarks.bench_families",
        "the families benchmark compiled (torch.compile of the whole model, default mode): CogVideoX-5B",
        ("--families", "cogvideox", "--compile", "default", "--iters", "2")),
}
