"""Throughput of ``sparsevid cache`` (clips/s): random clips (PNG frame folders or mp4) with captions encoded by a WanPipeline of random
weights, through ``sparsevid.data.cache_videos`` (decode, resize, the VAE's posterior mean, the text encoder, shard
writing).

Pipelines (``--pipelines``):
- "tiny": the test suite's tiny pipeline (a 4-channel VAE of base width 3, a 1-layer UMT5 of width 16) on 17-frame
  64 x 64 clips;
- "wan2.1": the Wan2.1 VAE at its real size (``AutoencoderKLWan()``'s defaults: base width 96, 16 latent channels,
  the VAE of Wan2.1-1.3B and 14B) and a UMT5 encoder of umT5-XXL's size (24 layers, width 4096), on 81-frame
  480 x 832 clips (the 1.3B model's 480p training clip: 21 x 60 x 104 latents).
The tokenizer is a word-level one over the captions' words (no download); prompts are padded to 512 tokens as
Wan's pipeline does, so the text encoder's work is that of any prompt.

    python -m benchmarks cache
    # CPU smoke run:
    python -m benchmarks --results /tmp/cache cache --device cpu --pipelines tiny --clips 2
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from .report import write_result
from .video_inputs import write_clips
from .run_info import run_metadata
from sparsevid.data import Encoder, cache_videos, find_videos
from sparsevid.data.families import WAN

WORDS = "a red cat runs on the grass blue ball rolls over sand dog jumps".split()
CLIPS = {"tiny": (17, 64, 64), "wan2.1": (81, 480, 832)}  # (frames, height, width)


def word_tokenizer(words: list[str]):
    """A UMT5-style tokenizer (pad 0, eos 1, unk 2) over ``words``, appending </s> as T5's does."""
    import tokenizers
    import transformers
    from tokenizers.processors import TemplateProcessing

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{word: i + 3 for i, word in enumerate(words)}}
    model = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    model.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    model.post_processor = TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=model, pad_token="<pad>", eos_token="</s>",
                                                unk_token="<unk>")


def wan_pipeline(size: str, device: torch.device, dtype: torch.dtype, transformer=None):
    """A WanPipeline of random weights: "tiny" (the test suite's) or "wan2.1" (real sizes), with ``transformer``
    (None: without one, enough to encode)."""
    import diffusers
    import transformers

    torch.manual_seed(0)
    tokenizer = word_tokenizer(WORDS)
    with torch.device(device):
        if size == "tiny":
            text_encoder = transformers.UMT5EncoderModel(transformers.UMT5Config(
                vocab_size=len(tokenizer), d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
                relative_attention_num_buckets=8))
            vae = diffusers.AutoencoderKLWan(base_dim=3, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                             temperal_downsample=[False, True, True],
                                             latents_mean=[0.1, -0.2, 0.3, 0.0], latents_std=[1.5, 0.5, 2.0, 1.0])
        else:  # umT5-XXL's shape, Wan2.1's VAE
            text_encoder = transformers.UMT5EncoderModel(transformers.UMT5Config(
                vocab_size=len(tokenizer), d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
                feed_forward_proj="gated-gelu", relative_attention_num_buckets=32))
            vae = diffusers.AutoencoderKLWan()
    pipe = diffusers.WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder.to(dtype), vae=vae.to(dtype),
                                 scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0),
                                 transformer=transformer)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def measure(size: str, args, device: torch.device) -> dict:
    """One pipeline: clips/s of a full run over ``args.clips`` clips after one warm-up clip."""
    frames, height, width = CLIPS[size]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    pipe = wan_pipeline(size, device, dtype)
    encoder = Encoder(pipe, WAN, {"patch_size": (1, 2, 2)}, f"random {size}")
    with tempfile.TemporaryDirectory() as work:
        videos = Path(work) / "videos"
        write_clips(videos, args.clips + 1, frames, height, width, args.format, WORDS)
        items = find_videos(videos)
        cache_videos(encoder, items[:1], Path(work) / "warmup", height, width, frames, progress=False)
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        report = cache_videos(encoder, items[1:], Path(work) / "cache", height, width, frames, progress=False)
        seconds = time.perf_counter() - start
    if report.written != args.clips:
        raise RuntimeError(f"{size}: {report.written} of {args.clips} clips written; skipped {report.skipped}")
    row = {"pipeline": size, "format": args.format, "clips": report.written, "frames": frames, "height": height, "width": width,
           "dtype": str(dtype).replace("torch.", ""), "seconds": seconds, "clips_per_s": report.written / seconds,
           "vae_parameters": sum(p.numel() for p in pipe.vae.parameters()),
           "text_encoder_parameters": sum(p.numel() for p in pipe.text_encoder.parameters())}
    print(f"{size:7s}: {row['clips_per_s']:.2f} clips/s ({report.written} clips of {frames} x {height} x {width} "
          f"in {seconds:.1f} s)", flush=True)
    del pipe, encoder
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def table(rows) -> str:
    lines = ["| pipeline | clip (frames x H x W) | files | VAE params | text encoder params | clips | s | clips/s |",
             "|---" * 8 + "|"]
    for r in rows:
        lines.append(f"| {r['pipeline']} | {r['frames']} x {r['height']} x {r['width']} | {r['format']} | "
                     f"{r['vae_parameters'] / 1e6:.1f}M | {r['text_encoder_parameters'] / 1e6:.0f}M | {r['clips']} | "
                     f"{r['seconds']:.1f} | {r['clips_per_s']:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder of the result; python -m benchmarks sets it")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--pipelines", default="tiny,wan2.1", help="comma list of tiny, wan2.1")
    parser.add_argument("--clips", type=int, default=8, help="clips timed per pipeline (after one warm-up clip)")
    parser.add_argument("--format", choices=("png", "mp4"), default="png",
                        help="the clips as folders of PNG frames or mp4 files (decoded with PyAV)")
    args = parser.parse_args(argv)
    sizes = args.pipelines.split(",")
    if not sizes or any(size not in CLIPS for size in sizes) or args.clips < 1:
        parser.error(f"--pipelines must list {sorted(CLIPS)} and --clips be >= 1")
    device = torch.device(args.device)
    rows = [measure(size, args, device) for size in sizes]
    meta = run_metadata(device, clips=args.clips)
    text = table(rows)
    write_result(args.out, meta, {"rows": rows}, text)
    print(json.dumps(meta))
    print(text)


if __name__ == "__main__":
    main()
