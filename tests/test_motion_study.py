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
