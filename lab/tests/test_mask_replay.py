"""Masks recorded from one sampling run and replayed in another (untrained tiny built-in model, CPU)."""
import pytest
import sparsevid as sv
import torch
from sparsevid_lab.eval.harness import sample_with_stats
from sparsevid_lab.eval.mask_replay import recording_masks, replaying_masks
from sparsevid_lab.model.builtin import BuiltinVideoDiT, tiny_config

JOBS = [("big red plain circle moving right on a black background", 0)]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return BuiltinVideoDiT(tiny_config()).eval()


def topk(keep: float) -> sv.SparseConfig:
    return sv.SparseConfig(rule="topk", topk=keep, backend="reference", block_q=64, block_k=64)


def test_replayed_masks_replace_the_predicted_ones(model):
    """A run under another budget with the recorded masks replayed samples the recording run's clip exactly (the
    masks alone set the sparse attention); without them it samples another one."""
    with recording_masks() as masks:
        recorded, _, _ = sample_with_stats(model, topk(0.5), JOBS, steps=2, guidance=None)
    assert masks and all(isinstance(m, sv.SparseMask) for m in masks)
    with replaying_masks(masks):
        replayed, _, _ = sample_with_stats(model, topk(0.25), JOBS, steps=2, guidance=None)
    own, _, _ = sample_with_stats(model, topk(0.25), JOBS, steps=2, guidance=None)
    assert torch.equal(replayed, recorded)
    assert not torch.equal(own, recorded)


def test_a_replay_that_does_not_match_its_recording_is_refused(model):
    with recording_masks() as masks:
        sample_with_stats(model, topk(0.5), JOBS, steps=2, guidance=None)
    with pytest.raises(ValueError, match="no recorded mask"):
        with replaying_masks(masks[:-1]):
            sample_with_stats(model, topk(0.5), JOBS, steps=2, guidance=None)
    with pytest.raises(ValueError, match="were not used"):
        with replaying_masks(masks + masks[:1]):
            sample_with_stats(model, topk(0.5), JOBS, steps=2, guidance=None)
