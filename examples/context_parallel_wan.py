"""A Wan video on several GPUs: diffusers' Ulysses context parallelism with sparsevid's sparse attention.

    torchrun --nproc-per-node 2 examples/context_parallel_wan.py --model /models/Wan2.1-T2V-14B-Diffusers \\
        --prompt "a red fox running through snow" --height 720 --width 1280 --flow-shift 5 --out fox.mp4

--model is a local diffusers-format directory or a hub name. Every rank loads the whole pipeline and runs
the same sampling loop with the same seed; inside the transformer the video tokens are split over the ranks
(``enable_parallelism``) and every self-attention runs sparse on the whole sequence of its rank's heads
(docs/context_parallel.md). Rank 0 writes the video. The number of ranks must divide the attention heads
(40 on Wan2.1-14B, 12 on 1.3B) and the video tokens (21 x 45 x 80 at 720p, 21 x 30 x 52 at 480p).
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from diffusers import AutoencoderKLWan, ContextParallelConfig, UniPCMultistepScheduler, WanPipeline
from diffusers.utils import export_to_video

import sparsevid as sv
from sparsevid.plan import parse_config

DEFAULT_CONFIG = "rule=hybrid,topk=0.05,topp=0.9,dense_steps=5,dense_layers=[0]"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="Wan pipeline: local diffusers directory or hub name")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--negative-prompt", default="")
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--width", type=int, default=832)
    parser.add_argument("--frames", type=int, default=81)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--guidance", type=float, default=5.0)
    parser.add_argument("--flow-shift", type=float, default=None,
                        help="UniPC flow shift (Wan: 3 at 480p, 5 at 720p); default: the pipeline's scheduler")
    parser.add_argument("--config", default=DEFAULT_CONFIG, metavar="SPEC",
                        help=f"SparseConfig as 'key=value,...' or a JSON file (default {DEFAULT_CONFIG})")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fps", type=int, default=16)
    parser.add_argument("--out", default="wan_context_parallel.mp4")
    args = parser.parse_args(argv)
    config = parse_config(args.config)

    dist.init_process_group("nccl")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    try:
        vae = AutoencoderKLWan.from_pretrained(args.model, subfolder="vae", torch_dtype=torch.float32)
        pipe = WanPipeline.from_pretrained(args.model, vae=vae, torch_dtype=torch.bfloat16).to(device)
        if args.flow_shift is not None:
            pipe.scheduler = UniPCMultistepScheduler.from_config(pipe.scheduler.config, flow_shift=args.flow_shift)
        # Wan2.2 A14B pipelines denoise with two transformers.
        for transformer in filter(None, (pipe.transformer, getattr(pipe, "transformer_2", None))):
            transformer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=dist.get_world_size()))
            sv.apply_sparse_attention(transformer, config)
        frames = pipe(prompt=args.prompt, negative_prompt=args.negative_prompt, height=args.height,
                      width=args.width, num_frames=args.frames, num_inference_steps=args.steps,
                      guidance_scale=args.guidance,
                      generator=torch.Generator(device).manual_seed(args.seed)).frames[0]
        if dist.get_rank() == 0:
            export_to_video(frames, args.out, fps=args.fps)
            print(f"wrote {args.out} ({len(frames)} frames) with sparse attention over {dist.get_world_size()} GPUs")
    finally:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
