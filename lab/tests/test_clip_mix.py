"""Mixed-resolution training: the weighted cycle of clip shapes and ``sparsevid train`` with several --clip."""
import json

import pytest
import torch

from sparsevid_lab.data import ClipMix, ProceduralVideos, weighted_cycle


@pytest.mark.parametrize("weights, cycle", [([1], [0]), ([1, 1], [0, 1]), ([2, 1], [0, 1, 0]),
                                            ([1, 3], [1, 0, 1, 1]), ([1, 1, 2], [2, 0, 1, 2])])
def test_weighted_cycle_spreads_each_shape_by_its_weight(weights, cycle):
    assert weighted_cycle(weights) == cycle


@pytest.mark.parametrize("weights", [[], [0, 1], [1.5], [True]])
def test_weighted_cycle_rejects_bad_weights(weights):
    with pytest.raises(ValueError, match="weights"):
        weighted_cycle(weights)


def test_clip_mix_draws_each_step_from_its_shape():
    short, long = ProceduralVideos(frames=2, height=8, width=8), ProceduralVideos(frames=4, height=16, width=12)
    mix = ClipMix([short, long], batch_sizes=[3, 1], weights=[1, 2])
    gen = torch.Generator().manual_seed(0)
    shapes = [tuple(mix.sample(step, gen)[0].shape) for step in range(6)]
    a, b = (3, 3, 2, 8, 8), (1, 3, 4, 16, 12)
    assert shapes == [b, a, b] * 2  # cycle [1, 0, 1]
    assert mix.steps_per_shape(6) == [2, 4] and mix.steps_per_shape(4) == [1, 3] and mix.steps_per_shape(0) == [0, 0]
    video, captions = mix.sample(1, torch.Generator().manual_seed(0))
    assert len(captions) == 3 and video.min() >= -1 and video.max() <= 1


def test_clip_mix_checks_its_lists():
    data = [ProceduralVideos(frames=2, height=8, width=8)] * 2
    with pytest.raises(ValueError, match="batch_sizes needs one entry per clip shape"):
        ClipMix(data, [4])
    with pytest.raises(ValueError, match="weights needs one entry per clip shape"):
        ClipMix(data, [4, 4], [1])
    with pytest.raises(ValueError, match="batch_sizes must be ints"):
        ClipMix(data, [4, 0])
    with pytest.raises(ValueError, match="datasets"):
        ClipMix([], [])


def test_train_cli_mixed_clips_alternate_and_are_recorded(tmp_path):
    from sparsevid_lab.cli import main
    from sparsevid_lab.model.builtin import load_builtin

    assert main(["train", "--out", str(tmp_path), "--tiny", "--max-steps", "3", "--warmup", "1",
                 "--clip", "4,32,32", "--clip", "2,16,24", "--batch-size", "2", "--batch-size", "3",
                 "--sample-steps", "2"]) == 0
    config = json.loads((tmp_path / "builtin.json").read_text())
    phase = config["training"]
    assert config["data"]["frames"] == 4 and phase["clip"] == [4, 32, 32] and phase["batch_size"] == 2
    assert phase["clips"] == [{"clip": [4, 32, 32], "batch_size": 2, "weight": 1, "steps": 2},
                              {"clip": [2, 16, 24], "batch_size": 3, "weight": 1, "steps": 1}]
    assert config["phases"][-1] == phase
    assert load_builtin(tmp_path).clip_shape == (3, 4, 32, 32)  # the first --clip is the model's


@pytest.mark.parametrize("extra, message", [
    (["--clip", "4,32,32", "--clip", "2,16,16", "--batch-size", "2"], "one --batch-size per --clip"),
    (["--batch-size", "2", "--batch-size", "2"], "one --batch-size per --clip"),
    (["--clip", "4,32,32", "--clip", "2,16,16", "--batch-size", "2", "--batch-size", "2", "--clip-weight", "1"],
     "one --clip-weight per --clip"),
    (["--clip", "4,30,32"], "height must be a positive multiple of the patch size 4"),
    (["--clip", "1,32,32"], "frames must be at least 2"),
])
def test_train_cli_rejects_bad_clip_lists(tmp_path, capsys, extra, message):
    from sparsevid_lab.cli import main

    assert main(["train", "--out", str(tmp_path), "--tiny", "--max-steps", "1", *extra]) == 2
    assert message in capsys.readouterr().err
