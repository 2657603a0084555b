"""Training-free mode: growing-sparsity schedules in SparseConfig, mask reuse / reduced search (MaskReuse),
and both wired into a tiny Wan transformer."""
from __future__ import annotations

import math

import pytest
import torch

import sparsevid as sv
from sparsevid.integration.step_context import StepContext
from sparsevid.ops import select_from_mass
from sparsevid.plan import MaskReuse

SMALL = {"block_q": 64, "block_k": 64, "backend": "reference"}


# ----------------------------------------------------------------------------- schedules

def test_linear_schedule_hits_its_targets_step_by_step():
    cfg = sv.SparseConfig(rule="hybrid", topk=0.4, topp=0.95, final_topk=0.1, final_topp=0.75, schedule="linear",
                          num_steps=11, dense_steps=1)
    assert cfg.plan(0, 0) is None
    for step in range(1, 11):
        plan = cfg.plan(0, step)
        frac = (step - 1) / 9
        assert plan.topk == pytest.approx(0.4 - 0.3 * frac) and plan.topp == pytest.approx(0.95 - 0.2 * frac)
    assert cfg.plan(0, 10).topk == pytest.approx(0.1) and cfg.plan(0, 10).topp == pytest.approx(0.75)
    assert cfg.plan(0, 30).topk == pytest.approx(0.1)     # past the last step: the final budget
    assert cfg.plan(0, None).topk == 0.4                  # unknown step: the starting budget


def test_cosine_schedule_and_integer_counts():
    cfg = sv.SparseConfig(rule="topk", topk=20, final_topk=4, schedule="cosine", num_steps=9)
    counts = [cfg.plan(0, s).topk for s in range(9)]
    assert counts == [round(20 - 16 * (0.5 - 0.5 * math.cos(math.pi * s / 8))) for s in range(9)]
    assert counts[0] == 20 and counts[-1] == 4 and counts[4] == 12
    assert all(isinstance(c, int) for c in counts) and counts == sorted(counts, reverse=True)
    assert cfg.plan(0, 3).topp == cfg.topp                # no final_topp: topp stays


def test_snr_schedule_follows_the_timestep():
    cfg = sv.SparseConfig(rule="topp", topp=0.96, final_topp=0.8, schedule="snr", dense_steps=2)
    assert cfg.plan(1, 1, timestep=900.0) is None
    for t in (999.0, 750.0, 500.0, 120.0, 0.0):
        assert cfg.plan(1, 5, timestep=t).topp == pytest.approx(0.96 - 0.16 * (1 - t / 1000))
    assert cfg.plan(1, 5).topp == 0.96                    # no timestep: the starting budget
    shifted = sv.SparseConfig(rule="topp", topp=0.96, final_topp=0.8, schedule="snr", num_train_timesteps=1.0)
    assert shifted.plan(0, 3, timestep=0.25).topp == pytest.approx(0.96 - 0.16 * 0.75)


def test_layer_overrides_keep_working_with_schedules():
    cfg = sv.SparseConfig(rule="hybrid", topk=0.3, topp=0.9, final_topk=0.1, schedule="linear", num_steps=5,
                          layer_overrides={1: {"topk": 0.5, "final_topk": 0.5}, 2: {"final_topp": 0.5},
                                           3: {"dense": True}, 4: {"rule": "topk", "refresh_interval": 3}})
    assert cfg.plan(0, 4).topk == pytest.approx(0.1)
    assert cfg.plan(1, 4).topk == 0.5                     # a constant budget for layer 1
    assert cfg.plan(2, 4).topp == pytest.approx(0.5) and cfg.plan(2, 2).topp == pytest.approx(0.7)
    assert cfg.plan(3, 4) is None
    assert cfg.plan(4, 2).rule == "topk" and cfg.plan(4, 2).refresh_interval == 3
    assert cfg.plan(0, 2).refresh_interval == 1
    again = sv.SparseConfig.from_json(cfg.to_json())
    assert again == cfg and again.plan(2, 3) == cfg.plan(2, 3)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(schedule="exp", final_topp=0.5), ValueError, "schedule must be one of"),
    (dict(schedule="linear", num_steps=10), ValueError, "needs final_topk and/or final_topp"),
    (dict(final_topp=0.5), ValueError, "schedule is 'constant'"),
    (dict(schedule="linear", final_topp=0.5), ValueError, "needs num_steps"),
    (dict(schedule="cosine", final_topp=0.5, num_steps=4, dense_steps=4), ValueError, "num_steps"),
    (dict(schedule="linear", final_topp=0.95, topp=0.9, num_steps=10), ValueError, "final_topp must not exceed"),
    (dict(schedule="linear", final_topk=0.5, topk=0.1, num_steps=10), ValueError, "final_topk must not exceed"),
    (dict(schedule="linear", final_topk=3, topk=0.1, num_steps=10), ValueError, "final_topk must be of the same kind"),
    (dict(schedule="linear", final_topk="0.1", num_steps=10), TypeError, "final_topk"),
    (dict(schedule="snr", final_topp=1.5), ValueError, "final_topp must be in"),
    (dict(schedule="snr", final_topp=0.5, num_train_timesteps=0), ValueError, "num_train_timesteps"),
    (dict(refresh_interval=0), ValueError, "refresh_interval must be an int >= 1"),
    (dict(refresh_search="cached"), ValueError, "refresh_search must be one of"),
    (dict(schedule="linear", final_topk=0.05, num_steps=5, layer_overrides={2: {"topk": 4}}), ValueError,
     r"layer_overrides\[2\].final_topk must be of the same kind"),
    (dict(layer_overrides={1: {"refresh_interval": -2}}), ValueError, r"layer_overrides\[1\].refresh_interval"),
    (dict(layer_overrides={1: {"schedule": "linear"}}), ValueError, "unknown fields"),
    (dict(layer_overrides={1: {"final_topp": 0.5}}), ValueError, r"layer_overrides\[1\] sets \['final_topp'\]"),
])
def test_bad_schedule_configs_raise_errors_naming_the_field(kwargs, error, match):
    with pytest.raises(error, match=match):
        sv.SparseConfig(**kwargs)


# ----------------------------------------------------------------------------- mask reuse

def qk(n=640, heads=2, dim=16, seed=0, batch=1):
    gen = torch.Generator().manual_seed(seed)
    centres = torch.randn(batch, heads, n // 64, dim, generator=gen).repeat_interleave(64, dim=2)
    return [2 * centres + 0.5 * torch.randn(batch, heads, n, dim, generator=gen) for _ in range(2)]


def plan_at(step, **kw):
    cfg = sv.SparseConfig(rule="topp", topp=0.9, final_topp=0.6, schedule="linear", num_steps=10, **SMALL, **kw)
    return cfg.plan(0, step)


@pytest.mark.parametrize("search", ["full", "within"])
def test_masks_are_reused_between_refreshes_and_refreshed_inside_the_old_mask(search):
    reuse = MaskReuse()
    q, k = qk()
    masks, sources = [], []
    for step in range(10):
        mask, source = reuse.mask(q, k, plan_at(step, refresh_interval=3, refresh_search=search), None, step=step)
        masks.append(mask)
        sources.append(source)
    refreshed = "predicted" if search == "full" else "within"
    assert sources == ["predicted", "reused", "reused", refreshed, "reused", "reused", refreshed, "reused",
                       "reused", refreshed]
    for step in (1, 2, 4, 5, 7, 8):
        assert masks[step] is masks[step - 1]
    for step in (3, 6, 9):
        expected, _ = sv.predict_mask(q, k, rule="topp", topp=plan_at(step).topp, block_q=64, block_k=64,
                                      backend="reference", within=masks[step - 1] if search == "within" else None)
        assert torch.equal(masks[step].keep, expected.keep)
    if search == "within":
        assert all(not (masks[s].keep & ~masks[s - 1].keep).any() for s in range(1, 10))
        assert masks[9].sparsity > masks[0].sparsity


def test_reuse_is_per_branch_and_dropped_on_a_new_generation_or_new_shape():
    reuse = MaskReuse()
    q, k = qk()
    q2, k2 = qk(seed=1)
    plan = plan_at(0, refresh_interval=4)
    cond, _ = reuse.mask(q, k, plan, None, step=0, branch=0)
    uncond, _ = reuse.mask(q2, k2, plan, None, step=0, branch=1)
    assert reuse.mask(q, k, plan, None, step=1, branch=0) == (cond, "reused")
    assert reuse.mask(q, k, plan, None, step=1, branch=1) == (uncond, "reused")
    assert reuse.mask(q2, k2, plan, None, step=2, branch=0, generation=1)[1] == "predicted"
    assert reuse.mask(q2, k2, plan, None, step=1, branch=0, generation=1)[1] == "predicted"  # step went back
    small_q, small_k = qk(n=576)
    assert reuse.mask(small_q, small_k, plan, None, step=2, branch=0, generation=1)[1] == "predicted"
    bigger = sv.SparseConfig(rule="topp", block_q=128, block_k=64, backend="reference", refresh_interval=4)
    assert reuse.mask(small_q, small_k, bigger.plan(0, 3), None, step=3, branch=0, generation=1)[1] == "predicted"
    assert reuse.mask(q, k, plan, None, step=None)[1] == "predicted"


def test_exact_refresh_selects_from_the_tile_masses_of_the_step_before():
    reuse = MaskReuse()
    q, k = qk()
    v = torch.randn_like(k)
    kw = dict(refresh_interval=2, refresh_search="exact")
    wanted, sources, masks, recorded = [], [], [], {}
    for step in range(6):
        plan = plan_at(step, **kw)
        wanted.append(reuse.wants_tile_mass(q, plan, step=step))
        mask, source = reuse.mask(q, k, plan, None, step=step)
        sources.append(source)
        masks.append(mask)
        if wanted[-1]:
            _, mass = sv.block_sparse_attention(q, k, v, mask, return_tile_mass=True, backend="reference")
            reuse.record_tile_mass(mass, step=step)
            recorded[step] = mass
    assert wanted == [False, True, False, True, False, True]
    assert sources == ["predicted", "reused", "exact", "reused", "exact", "reused"]
    _, first_stats = sv.predict_mask(q, k, rule="topp", topp=0.9, block_q=64, block_k=64, backend="reference")
    expected, _ = select_from_mass(recorded[1], masks[1], rule="topp", topp=plan_at(2).topp,
                                   row_share=first_stats.kept_mass)
    assert torch.equal(masks[2].keep, expected.keep)
    assert not (masks[4].keep & ~masks[2].keep).any() and not (masks[2].keep & ~masks[0].keep).any()
    # Without recorded masses an "exact" refresh searches within the old mask.
    fresh = MaskReuse()
    fresh.mask(q, k, plan_at(0, **kw), None, step=0)
    assert fresh.mask(q, k, plan_at(2, **kw), None, step=2)[1] == "within"
    with torch.enable_grad():
        assert not reuse.wants_tile_mass(q.requires_grad_(), plan_at(5, **kw), step=5)


def test_step_context_counts_guidance_branches_and_generations():
    ctx = StepContext()
    seen = []
    for t in (999, 999, 800, 800, 999, 700):
        ctx.begin_forward(torch.tensor([t]), None)
        seen.append((ctx.step, ctx.branch, ctx.generation))
    assert seen == [(0, 0, 1), (0, 1, 1), (1, 0, 1), (1, 1, 1), (0, 0, 2), (1, 0, 2)]
    ctx.reset()
    ctx.begin_forward(torch.tensor([700]), None)
    assert (ctx.step, ctx.branch, ctx.generation) == (0, 0, 3)


# ----------------------------------------------------------------------------- integration

def tiny_wan():
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    model = diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4,
        text_dim=16, freq_dim=32, ffn_dim=32, num_layers=2, cross_attn_norm=True, rope_max_seq_len=32)
    inputs = {"hidden_states": torch.randn(1, 4, 4, 16, 16), "encoder_hidden_states": torch.randn(1, 8, 16)}
    return model.eval(), inputs


@pytest.mark.parametrize("search", ["within", "exact"])
def test_training_free_schedule_in_a_transformer(search):
    model, inputs = tiny_wan()
    cfg = sv.SparseConfig(rule="topp", topp=0.95, final_topp=0.7, schedule="snr", dense_steps=1,
                          refresh_interval=2, refresh_search=search, **SMALL)
    sv.apply_sparse_attention(model, cfg, collect_stats=True)
    per_step = []
    with torch.no_grad():
        for t in (999, 900, 700, 500, 300, 100):
            for _ in range(2):  # classifier-free guidance: two passes per step
                model(**inputs, timestep=torch.tensor([t]), return_dict=False)
                per_step.append(sv.attention_stats(model))
    sources = [[s.get("mask_source") for s in stats] for stats in per_step]
    refreshed = "exact" if search == "exact" else "within"
    expected = [None, None, "predicted", "predicted", "reused", "reused", refreshed, refreshed, "reused",
                "reused", refreshed, refreshed]
    assert [s[0] for s in sources] == expected and [s[1] for s in sources] == expected
    assert all(s["dense"] for s in per_step[0])
    for stats in per_step[2:]:
        assert all(s["predict_ms"] is not None for s in stats)
    sparsity = [per_step[i][0]["sparsity"] for i in (2, 6, 10)]
    assert sparsity == sorted(sparsity) and sparsity[-1] > sparsity[0]
