"""The motion study's caption probe (benchmarks/motion_study.py, part captions) on the tiny model."""
import pytest

pytest.importorskip("diffusers")

from sparsevid_lab.studies import motion_study  # noqa: E402
from sparsevid_lab.data import ProceduralVideos, grammar  # noqa: E402
from sparsevid_lab.model.builtin import BuiltinVideoDiT, tiny_config  # noqa: E402


def test_a_swapped_caption_differs_from_the_true_one_in_that_attribute_only():
    import torch

    scenes = ProceduralVideos(4, 32, 32, max_objects=1).sample_scenes(6, torch.Generator().manual_seed(0))
    true = motion_study._captions(scenes, None)
    for name, place, words in motion_study.SWAPS:
        swapped = motion_study._captions(scenes, (place, words))
        for before, after in zip(true, swapped):
            (old,), background = grammar.parse_caption(before)
            (new,), new_background = grammar.parse_caption(after)
            assert new_background == background
            assert [i for i in range(5) if old[i] != new[i]] == [place], (name, before, after)


def test_caption_use_reports_the_object_loss_of_every_variant_at_every_noise_level():
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    model = BuiltinVideoDiT(tiny_config()).eval()
    found = motion_study.caption_use(model, clips=3, chunk=2)
    assert 0 < found["object_share"] < 1
    rows = found["levels"]
    assert list(rows) == [f"t {t}" for t in motion_study.NOISE_LEVELS]
    labels = {"true", "null", *(f"swap {name}" for name, _, _ in motion_study.SWAPS)}
    for row in rows.values():
        assert set(row) == labels and all(value > 0 for value in row.values())
        assert row["null"] != row["true"]  # the caption reaches the prediction
    assert "| t 0.3 |" in motion_study.caption_table(rows)


def test_the_weighted_loss_is_the_plain_mean_under_equal_weights_and_follows_the_objects():
    import torch

    from sparsevid_lab.model.builtin import pretraining_loss

    data = ProceduralVideos(4, 32, 32, max_objects=1)
    scenes = data.sample_scenes(2, torch.Generator().manual_seed(1))
    video = data.render(scenes)
    mask = data.object_mask(scenes, video)
    assert mask.shape == (2, 1, 4, 32, 32) and 0 < mask.float().mean() < 0.5
    assert not data.object_mask(scenes, data.render(scenes)).logical_xor(mask).any()  # deterministic

    def model(x, t, tokens):  # predicts zero velocity: the squared error is the target's square
        return torch.zeros_like(x)

    tokens, t, noise = data.tokenize(scenes.captions()), torch.full((2,), 0.5), torch.randn(video.shape)
    plain = pretraining_loss(model, video, tokens, t, noise)
    assert torch.allclose(pretraining_loss(model, video, tokens, t, noise, weight=torch.ones(2, 1, 4, 32, 32)), plain)
    objects_only = pretraining_loss(model, video, tokens, t, noise, weight=mask.float())
    squared = (noise - video).square()
    expected = (squared * mask).sum() / (mask.sum() * 3)
    assert torch.allclose(objects_only, expected)
    with pytest.raises(TypeError, match="weight"):
        pretraining_loss(model, video, tokens, t, noise, weight=mask)


def test_the_object_weight_lever_trains_a_step():
    import torch

    from sparsevid_lab.studies.builtin_study import train_phase

    torch.manual_seed(0)
    model = BuiltinVideoDiT(tiny_config()).train()
    summary = train_phase(model, (4, 32, 32), batch=2, seconds=60, seed=0, lr=1e-4, max_steps=1, object_weight=4.0)
    assert summary["steps"] == 1 and summary["final_loss"] > 0
    with pytest.raises(ValueError, match="object_weight"):
        train_phase(model, (4, 32, 32), batch=2, seconds=60, seed=0, lr=1e-4, max_steps=1, object_weight=0.0)


def test_frame_distance_mass_of_even_and_of_own_frame_attention():
    import torch

    frames, per_frame, dim = 4, 3, 8
    n = frames * per_frame
    flat = torch.zeros(2, 2, n, dim)  # equal logits: attention spread evenly over every key
    uniform = motion_study.uniform_frame_distance(frames)
    assert torch.allclose(uniform, torch.tensor([4, 6, 4, 2], dtype=torch.float64) / 16)
    assert torch.allclose(motion_study.frame_distance_mass(flat, flat, frames, chunk=5), uniform.expand(2, frames))
    own = torch.nn.functional.one_hot(torch.arange(n) // per_frame, dim).float().expand(2, 2, n, dim)
    mass = motion_study.frame_distance_mass(60 * own, own, frames, chunk=5)  # each query matches its frame's keys
    assert torch.allclose(mass.sum(-1), torch.ones(2, dtype=torch.float64))
    assert (mass[:, 0] > 0.999).all()


def test_temporal_attention_reports_every_layer_and_head_at_every_noise_level(tmp_path):
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    model = BuiltinVideoDiT(tiny_config()).eval()
    found = motion_study.temporal_attention(model, clips=2)
    frames = found["frames"]
    assert frames == model.clip_shape[1] and list(found["levels"]) == [f"t {t}" for t in motion_study.NOISE_LEVELS]
    for layers in found["levels"].values():
        shares = torch.tensor(layers, dtype=torch.float64)  # [layers, heads, frames]
        assert shares.shape == (1, 2, frames) and torch.allclose(shares.sum(-1), torch.ones(1, 2, dtype=torch.float64))
    table = motion_study.temporal_table(found)
    assert "| uniform attention |" in table and "| 0 | 1 |" in table
    assert motion_study.plot_temporal(found, tmp_path / "t.png").stat().st_size > 0


def test_a_lever_trains_on_other_data_with_the_models_own_captions():
    from sparsevid_lab.studies.builtin_study import train_phase
    from sparsevid_lab.data import grammar as words

    model = BuiltinVideoDiT(tiny_config())  # up to two objects a clip: captions longer than one object's
    assert words.max_caption_words(1) < model.data.caption_length
    summary = train_phase(model, (4, 32, 32), batch=2, seconds=60, seed=0, lr=1e-4, max_steps=1,
                          data_options={"max_objects": 1})
    assert summary["steps"] == 1 and model.data.max_objects == 2  # the model's own data are left as they were


def test_ground_truth_tracks_read_as_their_captioned_motion():
    """read_tracks on rendered clips: slides move along their captioned direction and read as it."""
    import torch

    for motion in ("moving left", "moving down"):
        data = ProceduralVideos(16, 64, 64, max_objects=1, motions=[motion])
        scenes = data.sample_scenes(4, torch.Generator().manual_seed(motion_study.TRACK_SEED))
        found = motion_study.read_tracks(data.render(scenes), motion_study._captions(scenes, None), motion)
        assert found["motion"] > 0.5 and found["along"] >= 0.1 and found["path"] >= found["drift"] >= found["along"]
        assert found["read_as"].get(motion, 0) >= 3 and sum(found["read_as"].values()) == 4
    still = data.render(scenes)[:, :, :1].expand(-1, -1, 16, -1, -1)  # the first frame held: nothing moves
    frozen = motion_study.read_tracks(still, motion_study._captions(scenes, None), "moving down")
    assert frozen["motion"] < 0.1 and abs(frozen["along"]) < 0.02 and frozen["drift"] < 0.02
    assert "moving down" not in frozen["read_as"]


def test_tracks_part_reads_every_motion_of_the_tiny_model():
    import torch

    torch.manual_seed(0)
    model = BuiltinVideoDiT(tiny_config()).eval()
    model.config["sampling"]["steps"] = 2
    rows = motion_study.motion_tracks(model, clips=1)
    assert list(rows) == list(grammar.MOTIONS)
    for motion, row in rows.items():
        assert len(row["captions"]) == 1 and sum(row["model"]["read_as"].values()) == 1
        assert (row["truth"]["along"] is None) == (motion not in motion_study.SLIDES)
    assert "| moving left |" in motion_study.tracks_table(rows)


def test_scratch_part_trains_the_small_model_and_reads_the_four_slides():
    model = motion_study.scratch_model()
    assert model.data.config()["motions"] == list(motion_study.SLIDES) and model.data.max_objects == 1
    assert 1e6 < sum(p.numel() for p in model.parameters()) < 2e6
    found = motion_study.learn_from_scratch(clips=1, seconds=60, batch=2, lr=5e-4, max_steps=1)
    assert found["training"]["steps"] == 1 and list(found["tracks"]) == list(motion_study.SLIDES)
    for row in found["tracks"].values():
        assert row["truth"]["motion"] > 0.5  # ground-truth slides at 8 x 32 x 32 read as their caption
