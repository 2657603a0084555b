"""Harness metrics against hand-computed values, config parsing, and the harness on a tiny model."""
import math

import pytest
import torch

from sparsevid.plan import parse_config
from sparsevid_lab.eval.harness import markdown_table, run_harness
from sparsevid.eval.video_metrics import SSIM_K1, SSIM_K2, psnr, ssim


def test_psnr_hand_computed():
    x = torch.zeros(2, 3, 2, 16, 16)
    y = x.clone()
    y[0] += 0.2  # 0.1 in [0, 1] units everywhere: MSE 0.01 -> 20 dB
    y[1, :, :, :8] = 1.0  # half the pixels off by 0.5: MSE 0.125 -> 9.03 dB
    p = psnr(y, x)
    assert p[0].item() == pytest.approx(20.0)
    assert p[1].item() == pytest.approx(10 * math.log10(1 / 0.125))
    assert psnr(x, x)[0].item() == math.inf


@pytest.mark.parametrize("a,b", [(0.5, 0.6), (0.1, 0.9), (0.3, 0.3)])
def test_ssim_of_constant_clips_hand_computed(a, b):
    """For constant frames the variances vanish: SSIM = (2ab + C1) / (a^2 + b^2 + C1)."""
    x = torch.full((1, 3, 2, 16, 16), 2 * a - 1, dtype=torch.float64)
    y = torch.full((1, 3, 2, 16, 16), 2 * b - 1, dtype=torch.float64)
    c1 = SSIM_K1**2
    assert ssim(x, y).item() == pytest.approx((2 * a * b + c1) / (a * a + b * b + c1), rel=1e-9)


def test_ssim_structure_terms():
    """A checkerboard of 0.5 +- d against its inverse, SSIM computed by hand window by window."""
    d = 0.2
    board = ((torch.arange(16).view(-1, 1) + torch.arange(16).view(1, -1)) % 2 * 2 - 1).double()  # +-1
    x = (0.5 + d * board).view(1, 1, 1, 16, 16) * 2 - 1
    y = (0.5 - d * board).view(1, 1, 1, 16, 16) * 2 - 1
    # Gaussian-weighted window statistics: with m the weighted mean of the +-1 board in the window, the
    # means are 0.5 +- d m, both variances d^2 (1 - m^2) and the covariance -d^2 (1 - m^2).
    g = torch.exp(-((torch.arange(11, dtype=torch.float64) - 5.0) ** 2) / (2 * 1.5**2))
    g = g / g.sum()
    w2 = torch.outer(g, g)
    values = []
    for i in range(6):
        for j in range(6):
            m = float((w2 * board[i:i + 11, j:j + 11]).sum())
            mx, my, var, cov = 0.5 + d * m, 0.5 - d * m, d * d * (1 - m * m), -d * d * (1 - m * m)
            c1, c2 = SSIM_K1**2, SSIM_K2**2
            values.append((2 * mx * my + c1) * (2 * cov + c2) / ((mx * mx + my * my + c1) * (2 * var + c2)))
    assert ssim(x, y).item() == pytest.approx(sum(values) / len(values), rel=1e-9)
    assert ssim(x, x).item() == pytest.approx(1.0)


def test_metric_input_checks():
    with pytest.raises(ValueError, match="same shape"):
        psnr(torch.zeros(1, 3, 2, 16, 16), torch.zeros(1, 3, 2, 16, 8))
    with pytest.raises(ValueError, match="at least 11"):
        ssim(torch.zeros(1, 3, 2, 8, 8), torch.zeros(1, 3, 2, 8, 8))
    with pytest.raises(ValueError, match=r"\[B, C, T, H, W\]"):
        psnr(torch.zeros(3, 16, 16), torch.zeros(3, 16, 16))


def test_parse_config():
    cfg = parse_config("rule=hybrid,topk=0.1,topp=0.8,dense_layers=[0,2],dense_steps=1,tile=[1,4,4]")
    assert (cfg.rule, cfg.topk, cfg.topp, cfg.dense_layers, cfg.dense_steps, cfg.tile) == \
        ("hybrid", 0.1, 0.8, (0, 2), 1, (1, 4, 4))
    assert parse_config("rule=topk,topk=3").topk == 3
    with pytest.raises(ValueError, match="key=value"):
        parse_config("hybrid")
    with pytest.raises(ValueError, match="unknown"):
        parse_config("rule=topk,bogus=1")
    with pytest.raises(ValueError, match="rule"):
        parse_config("rule=nope")


def test_harness_on_tiny_model():
    from sparsevid_lab.model.builtin import BuiltinVideoDiT, tiny_config

    torch.manual_seed(0)
    model = BuiltinVideoDiT(tiny_config()).eval()
    configs = {"full": parse_config("rule=topk,topk=1.0"), "one": parse_config("rule=topk,topk=1,tile=none"),
               "late": parse_config("rule=topk,topk=1,dense_steps=2,tile=none")}
    captions = ["big red plain circle bouncing on a black background"]
    results = run_harness(model, configs, captions=captions, seeds=[0, 1], steps=3, progress=False)
    full, one, late = (results["configs"][k] for k in ("full", "one", "late"))
    # Keeping every tile reproduces dense sampling and dense attention.
    assert full["sparsity"] == 0.0 and full["recall"] == pytest.approx(1.0) and full["rel_l1"] < 1e-5
    assert min(full["psnr_per_clip"]) > 60 and full["ssim"] == pytest.approx(1.0, abs=1e-6)
    # One key block of 4 per query block: 75% sparsity, recall < 1, a real output error.
    assert one["sparsity"] == pytest.approx(0.75)
    assert one["recall"] < 0.99 and one["rel_l1"] > 1e-3 and len(one["recall_per_layer"]) == 1
    # Two of three steps dense: a third of the calls sparse; the probe of step 0 sees a dense plan.
    assert late["sparsity"] == pytest.approx(0.25)
    # Every call is timed, dense ones included; the mask search is part of the attention call.
    assert all(r["attention_s"] > r["search_s"] >= 0.0 for r in (full, one, late))
    assert results["clips"]["dense"].shape == (2, *model.clip_shape)
    table = markdown_table(results)
    assert "| `one` | 0.750 |" in table and "layer 0" in table
    with pytest.raises(ValueError, match="probe_steps"):
        run_harness(model, configs, captions=captions, steps=3, probe_steps=[5], progress=False)
