"""The motion study's caption probe (benchmarks/motion_study.py, part captions) on the tiny model."""
import pytest

pytest.importorskip("diffusers")

from benchmarks import motion_study  # noqa: E402
from sparsevid.data import ProceduralVideos, grammar  # noqa: E402
from sparsevid.models.builtin import BuiltinVideoDiT, tiny_config  # noqa: E402


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

    from sparsevid.training.flow import flow_matching_loss

    data = ProceduralVideos(4, 32, 32, max_objects=1)
    scenes = data.sample_scenes(2, torch.Generator().manual_seed(1))
    video = data.render(scenes)
    mask = data.object_mask(scenes, video)
    assert mask.shape == (2, 1, 4, 32, 32) and 0 < mask.float().mean() < 0.5
    assert not data.object_mask(scenes, data.render(scenes)).logical_xor(mask).any()  # deterministic

    def model(x, t, tokens):  # predicts zero velocity: the squared error is the target's square
        return torch.zeros_like(x)

    tokens, t, noise = data.tokenize(scenes.captions()), torch.full((2,), 0.5), torch.randn(video.shape)
    plain = flow_matching_loss(model, video, tokens, t, noise)
    assert torch.allclose(flow_matching_loss(model, video, tokens, t, noise, weight=torch.ones(2, 1, 4, 32, 32)), plain)
    objects_only = flow_matching_loss(model, video, tokens, t, noise, weight=mask.float())
    squared = (noise - video).square()
    expected = (squared * mask).sum() / (mask.sum() * 3)
    assert torch.allclose(objects_only, expected)
    with pytest.raises(TypeError, match="weight"):
        flow_matching_loss(model, video, tokens, t, noise, weight=mask)


def test_the_object_weight_lever_trains_a_step():
    import torch

    from benchmarks.builtin_study import train_phase

    torch.manual_seed(0)
    model = BuiltinVideoDiT(tiny_config()).train()
    summary = train_phase(model, (4, 32, 32), batch=2, seconds=60, seed=0, lr=1e-4, max_steps=1, object_weight=4.0)
    assert summary["steps"] == 1 and summary["final_loss"] > 0
    with pytest.raises(ValueError, match="object_weight"):
        train_phase(model, (4, 32, 32), batch=2, seconds=60, seed=0, lr=1e-4, max_steps=1, object_weight=0.0)
