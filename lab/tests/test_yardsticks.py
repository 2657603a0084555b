"""The yardstick suite on the tiny model: noise floor, progress, calibration, and the faithfulness summary."""
import re

import pytest
import torch

import sparsevid as sv
from sparsevid.eval import mean_sparsity
from sparsevid_lab.eval.recording import record_video_attention, rules_at_sparsity
from sparsevid_lab.eval.noise_floor import every_tile_config
from sparsevid_lab.eval.suite import run_suite, suite_table
from sparsevid_lab.model.builtin import BuiltinVideoDiT, tiny_config

CAPTION = "big red plain circle bouncing on a black background"


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return BuiltinVideoDiT(tiny_config()).eval()


def test_suite_noise_floor_progress_and_entries(model, capsys):
    configs = {"one": sv.SparseConfig(rule="topk", topk=1, tile="none")}
    results = run_suite(model, configs, [CAPTION], seeds=[0, 1], steps=2, probe_steps=[1], heldout_per_bin=1,
                        noise_bins=2, oracle_sparsities=(0.5,), progress=True)
    # One bar, advanced per clip (2 clips x dense, config, every tile), per probed step and per held-out pass (reference, every tile, config).
    bars = re.findall(r"eval: 100%\|[^\n\r]*\| (\d+)/(\d+)", capsys.readouterr().err)
    assert bars and bars[-1] == ("10", "10")
    floor = results["noise_floor"]
    # fp32 on the CPU: the reference kernel with every tile kept is dense up to rounding.
    assert floor["sparsity"] == 0.0 and min(floor["psnr_per_clip"]) > 60 and floor["psnr"] < float("inf")
    assert results["noise_floor_psnr"] == floor["psnr"] and results["noise_floor_ssim"] == pytest.approx(1.0, abs=1e-6)
    assert floor["velocity_error"]["overall"] < 1e-5
    assert results["configs"]["one"]["psnr"] < results["noise_floor_psnr"]
    assert results["clips"]["every tile kept"].shape == results["clips"]["dense"].shape
    table = suite_table(results)
    assert "every tile kept (noise floor)" in table and "Smoke test" not in table
    assert "Smoke test" in suite_table(results, smoke_test=True)


def test_every_tile_config_keeps_every_tile():
    q, k = torch.randn(1, 2, 300, 32), torch.randn(1, 2, 300, 32)
    plan = every_tile_config().plan(0, 0)
    mask, _ = sv.predict_mask(q, k, **plan.predict_kwargs())
    assert mask.sparsity == 0.0


def test_rules_at_sparsity_reach_their_targets(model):
    configs = rules_at_sparsity(model, [0.5], CAPTION, seed=0, steps=2)
    assert set(configs) == {"topk 50%", "topp 50%", "hybrid 50%"}
    calls = record_video_attention(model, CAPTION, 0, steps=2)
    assert len(calls) == 2 and calls[0][0].shape == (2, 2, 256, 32)  # one layer, steps 0 and 1, CFG batch
    for name, config in configs.items():
        reached = mean_sparsity(calls, **{k: v for k, v in config.plan(0, 0).predict_kwargs().items()})
        # 4 key blocks per row: sparsity moves in steps of 1/4 per row, so targets are met to within a block.
        assert abs(reached - 0.5) <= 0.25, name
    with pytest.raises(ValueError, match="targets"):
        rules_at_sparsity(model, [1.0], CAPTION)


def test_faithfulness_summary_means_over_clips():
    from sparsevid_lab.data import ProceduralVideos
    from sparsevid_lab.eval.faithfulness import faithfulness
    from sparsevid_lab.eval.faithfulness_summary import summarize_faithfulness

    data = ProceduralVideos(frames=8, height=32, width=32, max_objects=2)
    clips, captions = data.sample(3, torch.Generator().manual_seed(0))
    scores = faithfulness(clips, captions)
    summary = summarize_faithfulness(clips, captions)
    assert summary["overall"] == pytest.approx(sum(s["overall"] for s in scores) / 3)
    assert summary["per_clip"] == pytest.approx([s["overall"] for s in scores])
    assert {"background", "count", "colour", "size", "motion"} <= set(summary["per_attribute"])
    for name, mean in summary["per_attribute"].items():
        values = [s[name] for s in scores if s.get(name) is not None]
        assert mean == pytest.approx(sum(values) / len(values)) and 0.0 <= mean <= 1.0
