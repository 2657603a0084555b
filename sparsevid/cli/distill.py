"""``sparsevid distill``: fine-tune a diffusers video transformer into a sparse student on cached latents."""
from __future__ import annotations

from pathlib import Path

from ..training.flow import FULL_RANGE
from .args import (CommandError, add_noise_range_option, config_spec_arg, default_device, device_arg,
                   positive_float_arg, positive_int_arg)


def add_parser(subparsers) -> None:
    summary = ("Fine-tune a diffusers video transformer (Wan, HunyuanVideo) with sparse attention to match its dense "
               "self (velocity distillation; or the diffusion loss as the baseline), on a folder of latents with "
               "their text-encoder states; write the student (fine-tuned tensors + sparse setting) to --out, "
               "loadable with sparsevid.load_student(pipe, OUT). Under torchrun, data-parallel.")
    p = subparsers.add_parser("distill", description=summary, help="Fine-tune a transformer into a sparse student.")
    p.add_argument("--model", required=True,
                   help="the dense transformer: a transformer or pipeline folder, or a hub id")
    p.add_argument("--data", required=True, help="folder of latent samples (sparsevid.training.latents)")
    p.add_argument("--out", required=True, help="output folder: training state, log, loss plot and the student")
    p.add_argument("--sparse", type=config_spec_arg, default=None,
                   help="the student's sparse attention: 'key=value,...' of SparseConfig or a JSON file (without it: "
                        "SparseConfig(), the hybrid of top-k and top-p)")
    p.add_argument("--objective", choices=("distill", "diffusion"), default="distill",
                   help="match the dense teacher's velocity, or the flow-matching target of the data")
    p.add_argument("--trainable", choices=("attention", "all", "lora"), default="attention",
                   help="fine-tune the self-attention modules only, every weight, or a LoRA adapter on the "
                        "self-attention projections (base weights frozen; needs peft)")
    p.add_argument("--lora-rank", type=positive_int_arg, default=64, help="rank of the LoRA adapter")
    p.add_argument("--lora-alpha", type=positive_float_arg, default=64.0,
                   help="LoRA scale numerator (the update is alpha / rank * B A)")
    p.add_argument("--steps", type=positive_int_arg, default=1000, help="optimiser steps")
    p.add_argument("--batch-size", type=positive_int_arg, default=8,
                   help="global batch of an optimiser step (over all processes and accumulation steps)")
    p.add_argument("--accumulation-steps", type=positive_int_arg, default=1,
                   help="micro-steps whose gradients make one optimiser step (less memory per step)")
    p.add_argument("--optimizer", choices=("adamw", "adamw8bit"), default="adamw",
                   help="AdamW (fused on CUDA) or bitsandbytes' 8-bit AdamW (CUDA; a quarter of the optimiser memory)")
    p.add_argument("--lr", type=positive_float_arg, default=1e-5, help="peak learning rate (AdamW)")
    p.add_argument("--warmup", type=int, default=50, help="linear warm-up steps")
    p.add_argument("--shift", type=positive_float_arg, default=1.0,
                   help="time shift of the training noise levels (logit-normal, then shifted)")
    add_noise_range_option(p, "train (and evaluate) only noise levels t in this range, e.g. one expert of Wan2.2 "
                              "A14B (boundary 0.875): 0.875,1 for PIPELINE/transformer, 0,0.875 for "
                              "PIPELINE/transformer_2")
    p.add_argument("--null-prob", type=float, default=0.1, help="probability of the empty prompt (caption dropout)")
    p.add_argument("--seed", type=int, default=0, help="seed of the noise, noise levels and caption dropout")
    p.add_argument("--data-seed", type=int, default=0, help="seed of the data order")
    p.add_argument("--gradient-checkpointing", action="store_true", help="recompute blocks in the backward pass")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default=None,
                   help="dtype of the frozen weights (default: bf16 on CUDA, fp32 on the CPU); the trained ones are "
                        "always float32 master weights, and CUDA steps run under bf16 autocast")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the transformer's repeated blocks (inductor; not with --parallel fsdp)")
    p.add_argument("--checkpoint-every", type=positive_int_arg, default=100, help="steps between training states")
    p.add_argument("--heldout", default=None,
                   help="folder of held-out latent samples: the student's velocity error against the dense model on "
                        "them is logged every --eval-every steps and at the end (OUT/eval.jsonl)")
    p.add_argument("--eval-every", type=positive_int_arg, default=100, help="steps between held-out evaluations")
    p.add_argument("--heldout-per-bin", type=positive_int_arg, default=2,
                   help="held-out triples per noise-level bin (5 bins)")
    p.add_argument("--resume", action="store_true", help="continue from --out's training state")
    p.add_argument("--parallel", choices=("ddp", "fsdp"), default="ddp",
                   help="under torchrun: replicate the model on every rank (ddp) or shard it (fsdp, FSDP2: for "
                        "models that do not fit one device, e.g. a full fine-tune of Wan 14B)")
    p.add_argument("--device", type=device_arg, default=default_device(), help="cpu, cuda or cuda:N")
    p.set_defaults(func=run)


def heldout_triples(data, per_bin: int, bins: int = 5, noise_range: tuple[float, float] = FULL_RANGE):
    """Held-out triples of a latent folder, all of one shape: the samples of its first run of the data order
    (one bucket; the whole folder when it holds one shape), reused when it holds fewer than needed; their noise
    levels stratified over ``noise_range``."""
    from ..eval import heldout_set

    return heldout_set(data, per_bin, bins, indices=[i % data.order.group for i in range(per_bin * bins)],
                       noise_range=noise_range)


def memory_advice(args) -> str:
    """What would cut a run's memory, among the options it does not use yet."""
    advice = []
    if not args.gradient_checkpointing:
        advice.append("--gradient-checkpointing (recompute the blocks: activations of one block at a time)")
    if args.trainable != "lora":
        advice.append("--trainable lora (frozen base weights, no gradients or optimiser state for them)")
    if args.optimizer != "adamw8bit":
        advice.append("--optimizer adamw8bit (a quarter of the optimiser state)")
    advice.append("--accumulation-steps (the batch in smaller micro-steps)")
    if args.parallel != "fsdp":
        advice.append("torchrun with --parallel fsdp (the model sharded over the GPUs)")
    return "; ".join(advice)


def run(args) -> int:
    import torch

    from ..plan import SparseConfig, parse_config
    from ..training import DistillConfig, LatentDirectory, LoopConfig, is_main_process, setup, teardown

    try:
        data = LatentDirectory(args.data, seed=args.data_seed)
        sparse = SparseConfig() if args.sparse is None else parse_config(args.sparse)
        config = DistillConfig(objective=args.objective, sparse=sparse, trainable=args.trainable,
                               batch_size=args.batch_size, seed=args.seed, shift=args.shift,
                               noise_range=args.noise_range, null_prob=args.null_prob,
                               gradient_checkpointing=args.gradient_checkpointing, lora_rank=args.lora_rank,
                               lora_alpha=args.lora_alpha, compile="inductor" if args.compile else None)
        loop = LoopConfig(lr=args.lr, warmup_steps=args.warmup, ema_decay=None, max_steps=args.steps,
                          weight_decay=0.0, checkpoint_every=args.checkpoint_every, progress=True,
                          accumulation_steps=args.accumulation_steps, optimizer=args.optimizer,
                          eval_every=args.eval_every if args.heldout else None)
        heldout = None
        if args.heldout is not None:
            heldout = heldout_triples(LatentDirectory(args.heldout), args.heldout_per_bin,
                                      noise_range=args.noise_range)
    except (FileNotFoundError, ValueError, TypeError) as error:
        raise CommandError(str(error)) from None
    job = setup(args.device)
    main = is_main_process()
    try:
        result = _train(args, job.device, data, config, loop, heldout)
    except (FileNotFoundError, TypeError, ValueError) as error:
        raise CommandError(str(error)) from None
    except torch.cuda.OutOfMemoryError:
        raise CommandError(f"out of GPU memory: try {memory_advice(args)}") from None
    finally:
        teardown()  # the transformer is gone with _train's frame: the process group can be freed
    if main and not result.history:
        print(f"nothing to train: the state in {args.out} is already at step {result.steps}")
    elif main:
        print(f"{result.steps} steps in {result.seconds:.0f} s, final loss {result.history[-1]['loss']:.4g}; "
              f"student in {Path(args.out)}")
    return 0


def _train(args, device, data, config, loop, heldout):
    """Load the transformer named by ``args.model`` onto ``device`` and distill it; returns the DistillResult."""
    import torch

    from ..eval import velocity_tracker
    from ..integration import load_transformer
    from ..training import distill

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype or ("bf16" if device.type == "cuda"
                                                                             else "fp32")]
    transformer = load_transformer(args.model, dtype=dtype, device=device)
    evaluate = None if heldout is None else velocity_tracker(transformer, heldout)
    return distill(transformer, data, config, loop, out=args.out, resume=args.resume, device=device,
                   extra={"model": str(args.model)}, evaluate=evaluate, parallel=args.parallel)
