"""`sparsevid cache` for pipeline families beyond Wan (tests/test_cache.py): a tiny pipeline of random components of
the family's own classes (saved, then loaded with from_pretrained; nothing downloads) encodes clips exactly as its own
VAE and text encoders do, stores its own samples, and `sparsevid distill` trains on the folder."""
import json
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("safetensors")
from PIL import Image  # noqa: E402

from benchmarks.bench_cache import WORDS, word_tokenizer  # noqa: E402
from sparsevid.cli import main  # noqa: E402
from sparsevid.data import family_for, fit, load_encoder  # noqa: E402
from sparsevid.training import (STREAM_TEACHER, DistillConfig, LatentBatch, LatentDirectory,  # noqa: E402
                                LoopConfig, distill, sample_generator)

SPARSE = "rule=topk,topk=1,block_q=64,block_k=64,tile=none"


def tiny_hunyuan_video():
    """HunyuanVideoPipeline: a 3-layer Llama of width 16 (the pipeline takes the states of its third-last layer), a
    CLIP text model of width 8 (its pooled output), a 4-channel HunyuanVideo VAE (8x spatial, 4x temporal), a
    guidance-distilled transformer of one double and one single block."""
    import diffusers
    import transformers

    torch.manual_seed(0)
    tokenizer = word_tokenizer(WORDS)
    special = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 1}
    llama = transformers.LlamaModel(transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=512, **special))
    clip = transformers.CLIPTextModel(transformers.CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
        max_position_embeddings=77, projection_dim=8, **special))
    vae = diffusers.AutoencoderKLHunyuanVideo(latent_channels=4, block_out_channels=(8, 8, 8, 8), layers_per_block=1,
                                              norm_num_groups=4, scaling_factor=0.476986)
    transformer = diffusers.HunyuanVideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=10, num_layers=1,
        num_single_layers=1, num_refiner_layers=1, patch_size=1, patch_size_t=1, guidance_embeds=True,
        text_embed_dim=16, pooled_projection_dim=8, rope_axes_dim=(2, 4, 4))
    return diffusers.HunyuanVideoPipeline(
        text_encoder=llama, tokenizer=tokenizer, text_encoder_2=clip, tokenizer_2=word_tokenizer(WORDS),
        vae=vae, transformer=transformer, scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=7.0))


def hunyuan_video_expected(pipe, pixels, caption):
    """What HunyuanVideoPipeline makes of ``pixels`` [1, 3, F, H, W] and ``caption`` with its own components:
    (latents [1, C, T, H, W] as its transformer takes them, {stored tensor: value})."""
    latents = pipe.vae.encode(pixels).latent_dist.mode() * pipe.vae.config.scaling_factor
    text, pooled, mask = pipe.encode_prompt(caption, max_sequence_length=256)
    return latents, {"text": text[0], "text_mask": mask[0], "extra.pooled_projections": pooled[0]}


def tiny_wan22_ti2v():
    """Wan2.2 TI2V-5B's pipeline: WanPipeline with ``expand_timesteps`` (per-token timesteps) and its 48-channel
    residual VAE (2x2 pixel patches inside, 16x spatial and 4x temporal compression), a 1-layer UMT5 of width 16."""
    import diffusers
    import transformers

    torch.manual_seed(0)
    tokenizer = word_tokenizer(WORDS)
    text_encoder = transformers.UMT5EncoderModel(transformers.UMT5Config(
        vocab_size=len(tokenizer), d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
        relative_attention_num_buckets=8))
    statistics = torch.linspace(-1, 1, 48)
    vae = diffusers.AutoencoderKLWan(
        base_dim=4, decoder_base_dim=4, z_dim=48, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
        temperal_downsample=[False, True, True], in_channels=12, out_channels=12, is_residual=True, patch_size=2,
        scale_factor_spatial=16, latents_mean=(0.3 * statistics).tolist(), latents_std=(1.2 + statistics).tolist())
    transformer = diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=48, out_channels=48,
        text_dim=16, freq_dim=32, ffn_dim=32, num_layers=2, cross_attn_norm=True, rope_max_seq_len=32)
    return diffusers.WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer,
                                 scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0),
                                 expand_timesteps=True)


def wan_expected(pipe, pixels, caption):
    """WanPipeline's encoding: (z - latents_mean) / latents_std per channel; the UMT5 states, no mask."""
    z = pipe.vae.encode(pixels).latent_dist.mode()
    mean, std = (torch.tensor(pipe.vae.config[name]).view(1, -1, 1, 1, 1) for name in ("latents_mean", "latents_std"))
    text, _ = pipe.encode_prompt(caption, do_classifier_free_guidance=False, max_sequence_length=512)
    return (z - mean) / std, {"text": text[0], "text_mask": None}


def tiny_t5():
    """(a word tokenizer, a 1-layer T5 encoder of width 16 over its vocabulary), random weights."""
    import transformers

    tokenizer = word_tokenizer(WORDS)
    return tokenizer, transformers.T5EncoderModel(transformers.T5Config(
        vocab_size=len(tokenizer), d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
        relative_attention_num_buckets=8))


def tiny_ltx():
    """LTXPipeline: a 1-layer T5 of width 16, an 8-channel LTX VAE (4x spatial and temporal compression) with
    non-trivial latent statistics and scaling factor, a 2-layer transformer."""
    import diffusers

    torch.manual_seed(0)
    tokenizer, text_encoder = tiny_t5()
    vae = diffusers.AutoencoderKLLTXVideo(
        latent_channels=8, block_out_channels=(8, 8, 8, 8), decoder_block_out_channels=(8, 8, 8, 8),
        layers_per_block=(1, 1, 1, 1, 1), decoder_layers_per_block=(1, 1, 1, 1, 1),
        spatio_temporal_scaling=(True, True, False, False), decoder_spatio_temporal_scaling=(True, True, False, False),
        decoder_inject_noise=(False,) * 5, upsample_residual=(False,) * 4, upsample_factor=(1,) * 4,
        timestep_conditioning=False, patch_size=1, patch_size_t=1, scaling_factor=0.7)
    vae.latents_mean.copy_(torch.linspace(-0.5, 0.5, 8))
    vae.latents_std.copy_(torch.linspace(0.5, 2.0, 8))
    transformer = diffusers.LTXVideoTransformer3DModel(
        in_channels=8, out_channels=8, num_attention_heads=2, attention_head_dim=12, cross_attention_dim=24,
        num_layers=2, caption_channels=16)
    return diffusers.LTXPipeline(scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), vae=vae,
                                 text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer)


def normalised_t5_expected(pipe, pixels, caption, mean, std, max_sequence_length: int):
    """The encoding of LTX and Mochi pipelines: (z - mean) * scaling_factor / std, with mean and std [C] the VAE's
    latent statistics; T5's states and mask padded to max_sequence_length."""
    z = pipe.vae.encode(pixels).latent_dist.mode()
    mean, std = (torch.as_tensor(values).view(1, -1, 1, 1, 1) for values in (mean, std))
    text, mask, _, _ = pipe.encode_prompt(caption, do_classifier_free_guidance=False,
                                          max_sequence_length=max_sequence_length)
    return (z - mean) * pipe.vae.config.scaling_factor / std, {"text": text[0], "text_mask": mask[0]}


def ltx_expected(pipe, pixels, caption):
    """LTXPipeline's encoding: the VAE's latents_mean / latents_std buffers, T5 padded to 128 tokens."""
    return normalised_t5_expected(pipe, pixels, caption, pipe.vae.latents_mean, pipe.vae.latents_std, 128)


def tiny_mochi():
    """MochiPipeline: a 1-layer T5 of width 16, a Mochi VAE of 32 channels per block (its own 6x temporal and 8x
    spatial compression, which the pipeline assumes) with non-trivial latent statistics and scaling factor, a
    2-layer transformer."""
    import diffusers

    torch.manual_seed(0)
    tokenizer, text_encoder = tiny_t5()
    vae = diffusers.AutoencoderKLMochi(
        encoder_block_out_channels=(32, 32, 32, 32), decoder_block_out_channels=(32, 32, 32, 32),
        layers_per_block=(1, 1, 1, 1, 1), add_attention_block=(False,) * 5,
        latents_mean=tuple(torch.linspace(-0.5, 0.5, 12).tolist()), latents_std=tuple(torch.linspace(0.5, 2.0, 12).tolist()),
        scaling_factor=0.7)
    transformer = diffusers.MochiTransformer3DModel(
        num_attention_heads=2, attention_head_dim=8, num_layers=2, pooled_projection_dim=16, text_embed_dim=16,
        time_embed_dim=4, max_sequence_length=256)
    return diffusers.MochiPipeline(scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), vae=vae,
                                   text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer)


def mochi_expected(pipe, pixels, caption):
    """MochiPipeline's encoding: the latent statistics of the VAE's config, T5 padded to 256 tokens."""
    return normalised_t5_expected(pipe, pixels, caption, pipe.vae.config.latents_mean, pipe.vae.config.latents_std,
                                  256)


def ltx_clip_inputs(fps, guidance):
    """LTXPipeline's RoPE scale: (VAE temporal factor / frame rate (default 25), spatial factor, spatial factor)."""
    return {"extra.rope_interpolation_scale": torch.tensor([4 / (25 if fps is None else fps), 4, 4],
                                                           dtype=torch.float64)}


def no_clip_inputs(fps, guidance):
    return {}


def hunyuan_video_clip_inputs(fps, guidance):
    """The embedded guidance HunyuanVideoPipeline passes: 1000 x its scale (default 6)."""
    return {"extra.guidance": torch.tensor(1000.0 * (6.0 if guidance is None else guidance))}


class Case(NamedTuple):
    """A tiny pipeline, the family that caches it, its own encoding of a clip and its caption (e.g.
    :func:`hunyuan_video_expected`), its inputs fixed by a clip's frame rate and guidance scale (None: the
    pipeline's default), a clip size (height, width) giving 288 or more video tokens at 2 x temporal + 1 frames, the
    VAE's temporal compression (clips have k x temporal + 1 frames)."""

    build: Callable
    family: str
    expected: Callable
    clip_inputs: Callable
    size: tuple[int, int]
    temporal: int = 4


CASES = {"hunyuan_video": Case(tiny_hunyuan_video, "hunyuan_video", hunyuan_video_expected, hunyuan_video_clip_inputs,
                               (64, 96)),
         "wan22_ti2v": Case(tiny_wan22_ti2v, "wan", wan_expected, no_clip_inputs, (256, 384)),
         "ltx": Case(tiny_ltx, "ltx", ltx_expected, ltx_clip_inputs, (32, 64)),
         "mochi": Case(tiny_mochi, "mochi", mochi_expected, no_clip_inputs, (128, 192), temporal=6)}  # 384: LTXPipeline takes 32k


@pytest.fixture(scope="module", params=list(CASES))
def pipeline_dir(request, tmp_path_factory):
    """(the case, the folder its tiny pipeline is saved in)."""
    folder = tmp_path_factory.mktemp(request.param)
    CASES[request.param].build().save_pretrained(folder)
    return CASES[request.param], folder


@pytest.fixture
def videos(tmp_path):
    """cat/ (9 PNG frames, 32 x 64) and dog/ (5 frames, 70 x 40), each with a .txt caption."""
    rng, root = np.random.default_rng(0), tmp_path / "videos"
    for name, (count, height, width) in {"cat": (9, 32, 64), "dog": (5, 70, 40)}.items():
        (root / name).mkdir(parents=True)
        for i, frame in enumerate(rng.integers(0, 256, (count, height, width, 3), dtype=np.uint8)):
            Image.fromarray(frame).save(root / name / f"{i:03d}.png")
    (root / "cat.txt").write_text("a red cat runs on the grass")
    (root / "dog.txt").write_text("dog jumps")
    return root


def _row(data, sample):
    """The LatentDirectory row (global index in epoch 0) holding sample ``sample``."""
    return next(i for i in range(len(data)) if data.sample(i) == sample)


def _stored(data, sample):
    """Sample ``sample``'s stored conditioning by stored name (text, text_mask, extra.<name>)."""
    batch = data.batch([_row(data, sample)])
    stored = {"text": batch.text[0], "text_mask": None if batch.text_mask is None else batch.text_mask[0]}
    return stored | {f"extra.{name}": value[0] for name, value in batch.extra.items()}


def test_cache_encodes_clips_as_the_pipeline_does(pipeline_dir, videos, tmp_path):
    case, folder = pipeline_dir
    out = tmp_path / "cache"
    assert main(["cache", "--pipeline", str(folder), "--videos", str(videos), "--out", str(out), "--device",
                 "cpu"]) == 0
    index = json.loads((out / "index.json").read_text())
    assert index["settings"]["family"] == case.family
    spatial = load_encoder(folder).spatial  # dog's 70 x 40 is cropped to a multiple of it (8 or 32)
    frames = [(count - 1) // case.temporal * case.temporal + 1 for count in (9, 5)]  # k x temporal + 1 at most
    assert [(s["source"], s["frames"], s["height"], s["width"]) for s in index["samples"]] == [
        ("cat", frames[0], 32, 64), ("dog", frames[1], 70 // spatial * spatial, 40 // spatial * spatial)]
    data = LatentDirectory(out, group=1)  # two buckets (sizes); runs of one sample: an epoch visits each once
    pipe = load_encoder(folder).pipe
    with torch.no_grad():
        for sample, record in enumerate(index["samples"]):
            frames = torch.stack([torch.from_numpy(np.array(Image.open(p))).permute(2, 0, 1)
                                  for p in sorted((videos / record["source"]).glob("*.png"))])
            pixels = fit(frames, record["height"], record["width"]).permute(1, 0, 2, 3)[None]
            latents, conditioning = case.expected(pipe, pixels, record["caption"])
            # the same float32 computation on the same inputs: equal up to the VAE's batch arithmetic
            assert torch.allclose(data.batch([_row(data, sample)]).latents, latents, atol=1e-6)
            _assert_same(_stored(data, sample), conditioning | case.clip_inputs(record["fps"], None))
        text, mask, *extra = data.null_text()
        null = {"text": text, "text_mask": mask} | {f"extra.{k}": v for k, v in (extra[0] if extra else {}).items()}
        _assert_same(null, case.expected(pipe, pixels, "")[1])


def _assert_same(stored, expected):
    """The stored conditioning {name: tensor or None} equals the pipeline's own, bit for bit."""
    assert stored.keys() == expected.keys()
    for key, value in expected.items():
        assert (stored[key] is None and value is None) or torch.equal(stored[key], value), key


def test_synthetic_data_is_sampled_unguided_unless_the_transformer_is_guidance_distilled(pipeline_dir):
    """The default guidance of ``cache --synthetic``: 1 for classifier-free guidance, the pipeline's own default for
    HunyuanVideo, whose transformer embeds the scale it was distilled at (6)."""
    case, folder = pipeline_dir
    encoder = load_encoder(folder)
    expected = 6.0 if case.family == "hunyuan_video" else 1.0
    assert encoder.family.synthetic_guidance(encoder.pipe) == expected


def test_synthetic_clips_are_the_pipelines_own_samples(pipeline_dir, tmp_path):
    case, folder = pipeline_dir
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red cat runs\nblue ball rolls over sand\n")
    out = tmp_path / "synthetic"
    assert main(["cache", "--pipeline", str(folder), "--synthetic", "2", "--prompts", str(prompts), "--out", str(out),
                 "--height", "32", "--width", "64", "--frames", str(case.temporal + 1), "--steps", "2", "--guidance", "4.5",
                 "--device", "cpu"]) == 0
    data = LatentDirectory(out)
    pipe = load_encoder(folder, transformer=True).pipe
    for sample, prompt in enumerate(["a red cat runs", "blue ball rolls over sand"]):
        expected = pipe(prompt=prompt, height=32, width=64, num_frames=case.temporal + 1, num_inference_steps=2,
                        guidance_scale=4.5,
                        output_type="latent", generator=sample_generator(0, sample, STREAM_TEACHER)).frames
        latents = data.batch([_row(data, sample)]).latents
        if expected.dim() == 3:  # LTX samples tokens [B, N, C]: the stored latents packed as its pipeline packs
            latents = pipe._pack_latents(latents, pipe.transformer_spatial_patch_size,
                                         pipe.transformer_temporal_patch_size)
        assert torch.allclose(latents, expected, atol=1e-6)
        stored, inputs = _stored(data, sample), case.clip_inputs(None, 4.5)  # the scale it was sampled at
        _assert_same({key: stored[key] for key in inputs}, inputs)


def test_distill_trains_on_the_cached_folder(pipeline_dir, tmp_path):
    """Sampled clips of 288 or more video tokens (5 or more key blocks of 64, one kept per row): the distillation
    loss falls, and `sparsevid distill` runs on the folder."""
    import diffusers

    import sparsevid as sv

    case, folder = pipeline_dir
    height, width = case.size
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red cat runs\nblue ball rolls over sand\ndog jumps\n")
    out = tmp_path / "clips"
    assert main(["cache", "--pipeline", str(folder), "--synthetic", "4", "--prompts", str(prompts), "--out", str(out),
                 "--height", str(height), "--width", str(width), "--frames", str(2 * case.temporal + 1), "--steps", "2",
                 "--device", "cpu"]) == 0
    data = LatentDirectory(out)
    class_name = json.loads((folder / "model_index.json").read_text())["transformer"][1]
    transformer = getattr(diffusers, class_name).from_pretrained(folder, subfolder="transformer")
    sparse = sv.SparseConfig(rule="topk", topk=1, block_q=64, block_k=64, tile="none")
    config = DistillConfig(sparse=sparse, batch_size=2, null_prob=0.5)
    loop = LoopConfig(lr=3e-3, warmup_steps=0, ema_decay=None, max_steps=24, log_every=1, bf16=False)
    losses = [row["loss"] for row in distill(transformer, data, config, loop, log=lambda *_: None).history]
    assert sum(losses[-4:]) < 0.7 * sum(losses[:4])  # 0.31 to 0.50 with these seeds
    assert main(["distill", "--model", str(folder), "--data", str(out), "--out", str(tmp_path / "student"),
                 "--sparse", SPARSE, "--steps", "2", "--batch-size", "2", "--warmup", "0", "--device", "cpu"]) == 0
    assert (tmp_path / "student" / "student.safetensors").is_file()


def test_an_unsupported_pipeline_is_refused_by_name():
    with pytest.raises(TypeError, match="HunyuanVideoPipeline.*not CogVideoXPipeline"):
        family_for("CogVideoXPipeline")


def test_caption_dropout_replaces_the_extra_inputs_of_the_empty_prompt():
    """A dropped row gets the empty prompt's pooled projection too; inputs the empty prompt lacks stay."""
    pooled, guidance = torch.randn(3, 8), torch.full((3,), 6000.0)
    batch = LatentBatch(torch.randn(3, 4, 1, 2, 2), torch.randn(3, 5, 16), torch.ones(3, 5, dtype=torch.long),
                        {"pooled_projections": pooled, "guidance": guidance})
    null = (torch.zeros(5, 16), torch.tensor([1, 0, 0, 0, 0]), {"pooled_projections": torch.full((8,), 7.0)})
    dropped = batch.drop_text(torch.tensor([False, True, False]), null)
    assert torch.equal(dropped.extra["pooled_projections"][[0, 2]], pooled[[0, 2]])
    assert torch.equal(dropped.extra["pooled_projections"][1], torch.full((8,), 7.0))
    assert torch.equal(dropped.extra["guidance"], guidance) and torch.equal(dropped.text_mask[1], null[1])


def test_predict_velocity_packs_latents_for_a_transformer_of_tokens():
    """LTX-Video's transformer takes patched tokens [B, N, C] with the latent grid and one RoPE scale per call:
    predict_velocity on 5D latents equals the call LTXPipeline makes (its own packing; patch size 1, as LTX-Video's
    models and RoPE grid take), unpacked as it unpacks; samples of different RoPE scales in one batch are refused
    by name."""
    import diffusers

    from sparsevid.training import predict_velocity
    from tiny_models import build

    torch.manual_seed(0)
    model, inputs = build("ltx")
    latents, t = torch.randn(2, 4, 4, 8, 10), torch.tensor([0.3, 0.8])
    scale = torch.tensor([8 / 25, 32.0, 32.0], dtype=torch.float64)
    batch = LatentBatch(latents, inputs["encoder_hidden_states"], inputs["encoder_attention_mask"],
                        {"rope_interpolation_scale": scale.expand(2, 3)})
    pipe = diffusers.LTXPipeline
    with torch.no_grad():
        expected = model(hidden_states=pipe._pack_latents(latents, 1, 1), encoder_hidden_states=batch.text,
                         timestep=1000 * t, encoder_attention_mask=batch.text_mask, num_frames=4, height=8, width=10,
                         rope_interpolation_scale=(8 / 25, 32.0, 32.0), return_dict=False)[0]
        velocity = predict_velocity(model, latents, t, batch)
    assert torch.equal(velocity, pipe._unpack_latents(expected, 4, 8, 10, 1, 1))
    half = batch.to("cpu", torch.bfloat16)  # as the velocity yardsticks run a bf16 model: the scale stays exact
    assert half.text.dtype == torch.bfloat16 and torch.equal(half.extra["rope_interpolation_scale"], scale.expand(2, 3))
    batch.extra["rope_interpolation_scale"] = torch.stack([scale, scale / 2])
    with pytest.raises(ValueError, match="rope_interpolation_scale.*differs"):
        predict_velocity(model, latents, t, batch)
