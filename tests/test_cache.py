"""`sparsevid cache` and the latent shard folders: a tiny WanPipeline with random weights (saved, then loaded with
from_pretrained; nothing downloads) encodes tiny videos (mp4, gif, a folder of PNG frames) into shards that
LatentDirectory and `sparsevid distill` read; resuming, bad items, bad shards, buckets and synthetic clips."""
import json

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("safetensors")
av = pytest.importorskip("av")
from PIL import Image  # noqa: E402

from benchmarks.bench_cache import wan_pipeline  # noqa: E402
from sparsevid.cli import main  # noqa: E402
from sparsevid.data import Encoder, cache_videos, find_videos, fit, load_encoder  # noqa: E402
from sparsevid.training import (STREAM_TEACHER, BucketOrder, LatentDirectory, ShardWriter,  # noqa: E402
                                sample_generator, write_null_text)

CAPTIONS = {"cat.mp4": "a red cat runs on the grass", "ball.gif": "blue ball rolls", "dog": "dog jumps over sand"}
SPARSE = "rule=topk,topk=1,block_q=64,block_k=64,tile=none"


def tiny_wan_pipeline():
    """A WanPipeline of random tiny components (the cache benchmark's "tiny": a word-level tokenizer, UMT5 of width
    16, a Wan VAE with 4 latent channels, 8x spatial and 4x temporal compression) with a 2-layer Wan transformer."""
    import diffusers

    torch.manual_seed(0)
    transformer = diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4,
        text_dim=16, freq_dim=32, ffn_dim=32, num_layers=2, cross_attn_norm=True, rope_max_seq_len=32)
    return wan_pipeline("tiny", torch.device("cpu"), torch.float32, transformer=transformer)


def random_frames(generator, count, height, width):
    return generator.integers(0, 256, (count, height, width, 3), dtype=np.uint8)


def write_mp4(path, frames, fps=8):
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())


@pytest.fixture(scope="module")
def pipeline_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pipeline")
    tiny_wan_pipeline().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def encoder(pipeline_dir):
    return load_encoder(pipeline_dir)


@pytest.fixture
def videos(tmp_path):
    """cat.mp4 (9 frames, 32 x 32), ball.gif (6 frames), dog/ (5 PNG frames, 40 x 56), each with a .txt caption;
    broken.mp4 (not a video) with a caption."""
    rng, root = np.random.default_rng(0), tmp_path / "videos"
    root.mkdir()
    write_mp4(root / "cat.mp4", random_frames(rng, 9, 32, 32))
    gif = [Image.fromarray(f) for f in random_frames(rng, 6, 32, 32)]
    gif[0].save(root / "ball.gif", save_all=True, append_images=gif[1:], duration=125)
    (root / "dog").mkdir()
    for i, frame in enumerate(random_frames(rng, 5, 40, 56)):
        Image.fromarray(frame).save(root / "dog" / f"{i:03d}.png")
    for source, caption in CAPTIONS.items():
        (root / (source.split(".")[0] + ".txt")).write_text(caption)
    (root / "broken.mp4").write_bytes(b"\x00\x00\x00\x18ftypisom" + b"not a video" * 20)
    (root / "broken.txt").write_text("a dog")
    return root


def cache(pipeline_dir, videos, out, *options):
    return main(["cache", "--pipeline", str(pipeline_dir), "--videos", str(videos), "--out", str(out),
                 "--device", "cpu", *options])


def test_cache_encodes_clips_as_the_pipeline_does(pipeline_dir, encoder, videos, tmp_path, capsys):
    out = tmp_path / "cache"
    assert cache(pipeline_dir, videos, out, "--height", "32", "--width", "32", "--frames", "5") == 0
    printed = capsys.readouterr()
    assert "skipped broken.mp4" in printed.err + printed.out and "3 clips encoded" in printed.out
    index = json.loads((out / "index.json").read_text())
    assert [s["source"] for s in index["samples"]] == ["ball.gif", "cat.mp4", "dog"]
    assert index["skipped"][0]["source"] == "broken.mp4" and "not a readable video" in index["skipped"][0]["reason"]
    dog = index["samples"][2]
    assert (dog["height"], dog["width"], dog["frames"], dog["source_size"]) == (32, 32, 5, [40, 56])
    data = LatentDirectory(out)
    transformer = encoder.pipe.transformer
    assert data.latent_shape == (transformer.config.in_channels, 2, 4, 4) and data.text_shape == (512, 16)
    pipe = encoder.pipe
    with torch.no_grad():
        for sample, record in enumerate(index["samples"]):
            stored = data.batch([next(i for i in range(3) if data.sample(i) == sample)])
            expected, _ = pipe.encode_prompt(record["caption"], do_classifier_free_guidance=False,
                                             max_sequence_length=512)
            assert torch.equal(stored.text[0], expected[0]) and stored.text_mask is None
        frames = torch.stack([torch.from_numpy(np.array(Image.open(p))).permute(2, 0, 1)
                              for p in sorted((videos / "dog").iterdir())])
        pixels = fit(frames, 32, 32).permute(1, 0, 2, 3)[None]
        z = pipe.vae.encode(pixels).latent_dist.mode()
        mean = torch.tensor(pipe.vae.config.latents_mean).view(1, 4, 1, 1, 1)
        std = torch.tensor(pipe.vae.config.latents_std).view(1, 4, 1, 1, 1)
        dog_row = next(i for i in range(3) if data.sample(i) == 2)
        assert torch.allclose(data.batch([dog_row]).latents, (z - mean) / std, atol=1e-6)
        null, _ = pipe.encode_prompt("", do_classifier_free_guidance=False, max_sequence_length=512)
        assert torch.equal(data.null_text()[0], null[0])


def test_cache_resumes_without_encoding_again(encoder, videos, tmp_path, monkeypatch):
    calls = []
    latents = Encoder.latents
    monkeypatch.setattr(Encoder, "latents", lambda self, video: calls.append(1) or latents(self, video))
    out, items = tmp_path / "cache", find_videos(videos)
    first = cache_videos(encoder, items[:3], out, 32, 32, 5, shard_size=2, progress=False, log=lambda _: None)
    assert (first.written, len(calls)) == (2, 2)  # ball.gif, cat.mp4; broken.mp4 skipped before encoding
    shard = out / "shard_00000.safetensors"
    stamp = shard.stat().st_mtime_ns
    again = cache_videos(encoder, items, out, 32, 32, 5, shard_size=2, progress=False, log=lambda _: None)
    assert (again.written, again.total, len(calls)) == (1, 3, 3)  # only the dog is new; the bad item retried
    assert shard.stat().st_mtime_ns == stamp and [s["source"] for s in again.skipped] == ["broken.mp4"]
    assert cache_videos(encoder, items, out, 32, 32, 5, shard_size=2, progress=False).written == 0
    assert len(calls) == 3 and len(LatentDirectory(out)) == 3
    with pytest.raises(ValueError, match="other settings"):
        cache_videos(encoder, items, out, 32, 32, 9, progress=False)


def test_an_interrupted_run_keeps_what_it_wrote(encoder, videos, tmp_path, monkeypatch):
    latents = Encoder.latents

    def failing(self, video):
        if failing.calls == 2:
            raise KeyboardInterrupt
        failing.calls += 1
        return latents(self, video)
    failing.calls = 0
    monkeypatch.setattr(Encoder, "latents", failing)
    out, items = tmp_path / "cache", find_videos(videos)
    with pytest.raises(KeyboardInterrupt):
        cache_videos(encoder, items, out, 32, 32, 5, shard_size=16, progress=False, log=lambda _: None)
    assert len(LatentDirectory(out)) == 2  # the unfilled shard was written on the way out
    monkeypatch.setattr(Encoder, "latents", latents)
    assert cache_videos(encoder, items, out, 32, 32, 5, shard_size=16, progress=False, log=lambda _: None).written == 1
    index = json.loads((out / "index.json").read_text())
    assert len(index["shards"]) == 1 and index["shards"][0]["samples"] == 3  # extended, not duplicated


def test_manifest_buckets_and_distill_on_the_cache(pipeline_dir, videos, tmp_path):
    """Clips keep their own sizes and lengths (three buckets); a JSONL manifest gives the captions; `distill
    --data` trains on the folder, every batch from one bucket."""
    manifest = tmp_path / "captions.jsonl"
    manifest.write_text("".join(json.dumps({"video": s, "caption": c}) + "\n" for s, c in CAPTIONS.items()))
    for source in CAPTIONS:
        (videos / (source.split(".")[0] + ".txt")).unlink()
    out = tmp_path / "cache"
    assert cache(pipeline_dir, videos, out, "--captions", str(manifest)) == 0
    data = LatentDirectory(out, group=2)
    assert sorted(data.buckets) == ["latents:4x2x4x4;text:512x16", "latents:4x2x4x6;text:512x16",
                                    "latents:4x3x4x4;text:512x16"]
    for step in range(6):
        assert data.batch([2 * step, 2 * step + 1]).latents.shape[0] == 2
    with pytest.raises(ValueError, match="buckets"):
        data.batch([1, 2])
    csv = tmp_path / "captions.csv"
    csv.write_text("video,caption\n" + "".join(f"{s},{c}\n" for s, c in CAPTIONS.items()))
    assert [i.caption for i in find_videos(videos, csv)] == list(CAPTIONS.values())
    assert main(["distill", "--model", str(pipeline_dir), "--data", str(out), "--out", str(tmp_path / "student"),
                 "--sparse", SPARSE, "--steps", "2", "--batch-size", "2", "--warmup", "0", "--device", "cpu"]) == 0
    assert (tmp_path / "student" / "student.safetensors").is_file()


def test_synthetic_clips_are_the_pipelines_own_samples(pipeline_dir, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red cat runs\n\nblue ball rolls over sand\n")
    out = tmp_path / "synthetic"
    assert main(["cache", "--pipeline", str(pipeline_dir), "--synthetic", "3", "--prompts", str(prompts),
                 "--out", str(out), "--height", "32", "--width", "32", "--frames", "5", "--steps", "2",
                 "--device", "cpu"]) == 0
    data = LatentDirectory(out)
    index = json.loads((out / "index.json").read_text())
    assert len(data) == 3 and data.latent_shape == (4, 2, 4, 4)
    assert [s["caption"] for s in index["samples"]] == ["a red cat runs", "blue ball rolls over sand", "a red cat runs"]
    pipe = load_encoder(pipeline_dir, transformer=True).pipe
    # without --guidance the teacher samples unguided (guidance 1: one transformer call per step)
    assert index["settings"]["guidance"] == 1.0
    expected = pipe(prompt="a red cat runs", height=32, width=32, num_frames=5, num_inference_steps=2,
                    guidance_scale=1.0, output_type="latent", generator=sample_generator(0, 2, STREAM_TEACHER)).frames
    row = next(i for i in range(3) if data.sample(i) == 2)
    assert torch.allclose(data.batch([row]).latents, expected, atol=1e-6)
    # Two clips per pipeline call: the same clips (each keeps its own generator), up to float32 batch arithmetic.
    assert main(["cache", "--pipeline", str(pipeline_dir), "--synthetic", "3", "--prompts", str(prompts),
                 "--out", str(tmp_path / "batched"), "--height", "32", "--width", "32", "--frames", "5", "--steps", "2",
                 "--batch-size", "2", "--device", "cpu"]) == 0
    batched = LatentDirectory(tmp_path / "batched")
    assert json.loads((tmp_path / "batched" / "index.json").read_text())["samples"] == index["samples"]
    for sample in range(3):
        rows = [next(i for i in range(3) if folder.sample(i) == sample) for folder in (data, batched)]
        assert torch.allclose(batched.batch([rows[1]]).latents, data.batch([rows[0]]).latents, atol=1e-5)
    assert main(["cache", "--pipeline", str(pipeline_dir), "--synthetic", "3", "--out", str(out), "--device",
                 "cpu"]) == 2
    assert main(["cache", "--pipeline", str(tmp_path / "nothing"), "--synthetic", "3", "--prompts", str(prompts),
                 "--out", str(out), "--height", "32", "--width", "32", "--frames", "5", "--device", "cpu"]) == 2
    assert main(["cache", "--pipeline", str(pipeline_dir), "--synthetic", "3", "--prompts", str(prompts),
                 "--out", str(out), "--height", "32", "--width", "32", "--frames", "6", "--device", "cpu"]) == 2
    errors = capsys.readouterr().err
    assert "--prompts" in errors and "nothing: no such folder" in errors and "--frames 6: must be k * 4 + 1" in errors


def _written(tmp_path, count=3, shard_size=2):
    out = tmp_path / "shards"
    with ShardWriter(out, {"test": 1}, shard_size) as writer:
        for i in range(count):
            writer.add(torch.randn(4, 2, 4, 4), torch.randn(6, 16), metadata={"source": f"s{i}"})
    write_null_text(out, torch.zeros(6, 16))
    return out


@pytest.mark.parametrize("damage, message", [
    (lambda p: p.write_bytes(b""), "truncated"),
    (lambda p: p.write_bytes(p.read_bytes()[:-100]), "truncated"),
    (lambda p: p.write_bytes(b"\xff" * p.stat().st_size), "empty, truncated or corrupt"),
], ids=["empty", "truncated", "garbled"])
def test_a_damaged_shard_is_named_on_opening(tmp_path, damage, message):
    out = _written(tmp_path)
    damage(out / "shard_00001.safetensors")
    with pytest.raises(ValueError, match=f"shard_00001.safetensors.*{message}"):
        LatentDirectory(out)


def test_corrupt_values_and_index_are_named(tmp_path):
    out = _written(tmp_path)
    shard = out / "shard_00000.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[-6 * 16 * 4 * 2 - 64:] = b"\xff" * (6 * 16 * 4 * 2 + 64)  # NaN bytes over the end of the data
    shard.write_bytes(bytes(raw))
    data = LatentDirectory(out)
    with pytest.raises(ValueError, match="shard_00000.safetensors row .*non-finite"):
        data.batch([0, 1, 2])
    (out / "index.json").write_text('{"format": "sparsevid-latent-shards", "vers')
    with pytest.raises(ValueError, match="index.json: not a readable shard index"):
        LatentDirectory(out)


def test_shard_writer_extends_the_last_shard_and_orders_by_bucket(tmp_path):
    out = _written(tmp_path, count=3, shard_size=2)
    with ShardWriter(out, {"test": 1}, 2) as writer:
        assert writer.done == {"s0", "s1", "s2"}
        writer.add(torch.randn(4, 2, 4, 4), torch.randn(6, 16), metadata={"source": "s3"})
        writer.add(torch.randn(4, 1, 4, 4), torch.randn(6, 16), metadata={"source": "other shape"})
    index = json.loads((out / "index.json").read_text())
    assert [s["samples"] for s in index["shards"]] == [2, 2, 1]
    data = LatentDirectory(out, group=2)
    assert len(data) == 5 and data.latent_shape == (4, 2, 4, 4) and len(data.buckets) == 2
    with pytest.raises(ValueError, match="other settings"):
        ShardWriter(out, {"test": 2})


@pytest.mark.parametrize("sizes, group", [((5,), 64), ((5, 3, 1), 2), ((4, 4), 4)], ids=["one", "three", "even"])
def test_bucket_order_keeps_aligned_runs_in_one_bucket(sizes, group):
    order = BucketOrder(sizes, group, seed=3)
    for epoch in range(2):
        visits = [order(epoch * order.epoch_length + i) for i in range(order.epoch_length)]
        assert set(visits) == {(b, p) for b, n in enumerate(sizes) for p in range(n)}  # every sample each epoch
        for start in range(0, order.epoch_length, order.group):
            assert len({bucket for bucket, _ in visits[start:start + order.group]}) == 1
    assert order.epoch_length == (sizes[0] if len(sizes) == 1 else sum(-(-n // group) * group for n in sizes))


def test_cache_distill_load_and_generate_end_to_end(pipeline_dir, tmp_path):
    """The real-model recipe on the tiny pipeline: clips sampled from the dense teacher itself are cached, a sparse
    student is distilled on them (the loss and its held-out velocity error against the teacher fall), written,
    loaded onto a freshly loaded pipeline in one call, where it gives the trained student's velocity, and the
    pipeline generates with it."""
    import diffusers

    import sparsevid as sv
    from sparsevid.eval import heldout_set, predict_velocities, velocity_error, velocity_tracker
    from sparsevid.training import DistillConfig, LoopConfig, distill

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red cat runs\nblue ball rolls over sand\ndog jumps\n")
    data_dir = tmp_path / "clips"
    assert main(["cache", "--pipeline", str(pipeline_dir), "--synthetic", "8", "--prompts", str(prompts),
                 "--out", str(data_dir), "--height", "64", "--width", "192", "--frames", "9", "--steps", "2",
                 "--device", "cpu"]) == 0
    data = LatentDirectory(data_dir)
    # 9 frames of 64 x 192: 3 x 4 x 12 = 144 video tokens, 3 key blocks of 64; one kept per row
    sparse = sv.SparseConfig(rule="topk", topk=1, block_q=64, block_k=64, tile="none")
    transformer = diffusers.WanTransformer3DModel.from_pretrained(pipeline_dir, subfolder="transformer")
    heldout = heldout_set(data, per_bin=2, num_bins=2)
    dense = predict_velocities(transformer, heldout)
    training_free = velocity_error(predict_velocities(transformer, heldout, sparse), dense, heldout)["overall"]
    loop = LoopConfig(lr=3e-3, warmup_steps=2, ema_decay=None, max_steps=30, log_every=5, bf16=False, eval_every=30)
    result = distill(transformer, data, DistillConfig(sparse=sparse, batch_size=2), loop, out=tmp_path / "student",
                     log=lambda *_: None, evaluate=velocity_tracker(transformer, heldout))
    losses = [row["loss"] for row in result.history]
    assert sum(losses[-2:]) < sum(losses[:2])
    assert result.evaluations[-1]["heldout_velocity_error"] < training_free
    trained = predict_velocities(transformer, heldout)

    pipe = diffusers.WanPipeline.from_pretrained(pipeline_dir)
    assert sv.load_student(pipe, tmp_path / "student") == sparse and sv.is_sparse(pipe.transformer)
    assert torch.allclose(predict_velocities(pipe.transformer, heldout), trained, atol=1e-2)
    frames = pipe(prompt="a red cat runs", height=64, width=192, num_frames=9, num_inference_steps=2,
                  output_type="pt", generator=torch.Generator().manual_seed(0)).frames
    assert frames.shape[:2] == (1, 9) and torch.isfinite(frames).all()


def test_evaluate_takes_a_folder_of_several_shapes(pipeline_dir, videos, tmp_path):
    """Held-out triples come from one bucket, so a folder of clips of several sizes can be evaluated."""
    out = tmp_path / "cache"
    assert cache(pipeline_dir, videos, out) == 0
    assert len(LatentDirectory(out).buckets) == 3
    assert main(["evaluate", "--model", str(pipeline_dir), "--data", str(out), "--sparse", SPARSE, "--per-bin", "1",
                 "--bins", "2", "--device", "cpu", "--out", str(tmp_path / "eval.json")]) == 0
    assert json.loads((tmp_path / "eval.json").read_text())["heldout"]["triples"] == 2
