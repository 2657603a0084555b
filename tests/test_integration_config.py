"""SparseConfig validation, serialisation and the per-(layer, step) decision; denoising-step counting."""
import warnings

import pytest
import torch

import sparsevid as sv
from sparsevid.integration.step_context import StepContext
from sparsevid.ops import PredictSettings
from sparsevid.ops.settings import forget_warnings
from sparsevid.plan import MASK_SETTINGS, LayerPlan, LayerRuntime, StepPosition


def test_json_round_trip_keeps_every_field():
    cfg = sv.SparseConfig(rule="topk", topk=3, topp=0.8, block_q=64, block_k=128, backend="reference",
                          keep_sink=True, similarity_threshold=0.5, dense_layers=[2, 0], dense_steps=4,
                          layer_overrides={1: {"topk": 0.2, "tile": (1, 4, 4)}, 3: {"dense": True}}, tile=(2, 4, 8))
    back = sv.SparseConfig.from_json(cfg.to_json())
    assert back == cfg
    assert back.dense_layers == (0, 2) and back.tile == (2, 4, 8)
    assert back.layer_overrides[1]["tile"] == (1, 4, 4)
    assert sv.SparseConfig.from_dict(sv.SparseConfig().to_dict()) == sv.SparseConfig()


@pytest.mark.parametrize("kwargs, error, field", [
    ({"rule": "top"}, ValueError, "rule"),
    ({"topk": 0.0}, ValueError, "topk"),
    ({"topk": 1.5}, ValueError, "topk"),
    ({"topk": "5%"}, TypeError, "topk"),
    ({"topp": 0.0}, ValueError, "topp"),
    ({"block_q": 32}, ValueError, "block_q"),
    ({"block_k": 64.0}, ValueError, "block_k"),
    ({"backend": "cuda"}, ValueError, "backend"),
    ({"keep_sink": 1}, TypeError, "keep_sink"),
    ({"min_blocks": -1}, ValueError, "min_blocks"),
    ({"dense_layers": (-1,)}, ValueError, "dense_layers"),
    ({"dense_layers": [0, "1"]}, ValueError, "dense_layers"),
    ({"dense_layers": "0,5"}, ValueError, "dense_layers"),
    ({"schedule": "snr", "final_topk": 0.01, "num_train_timesteps": float("nan")}, ValueError, "num_train_timesteps"),
    ({"schedule": "snr", "final_topk": 0.01, "num_train_timesteps": float("inf")}, ValueError, "num_train_timesteps"),
    ({"dense_steps": 1.5}, ValueError, "dense_steps"),
    ({"tile": (1, 2)}, ValueError, "tile"),
    ({"layer_overrides": {0: {"topk": 2.0}}}, ValueError, "layer_overrides[0].topk"),
    ({"layer_overrides": {0: {"sparsity": 0.9}}}, ValueError, "sparsity"),
    ({"layer_overrides": {"a": {}}}, ValueError, "layer_overrides"),
    ({"layer_overrides": {0: {"dense": "yes"}}}, TypeError, "layer_overrides[0].dense"),
], ids=lambda v: str(v) if not isinstance(v, dict) else "-".join(map(str, v)))
def test_bad_fields_name_the_field(kwargs, error, field):
    with pytest.raises(error, match=field.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")):
        sv.SparseConfig(**kwargs)


def test_from_dict_rejects_unknown_keys():
    with pytest.raises(ValueError, match="sparsity"):
        sv.SparseConfig.from_dict({"sparsity": 0.9})


def test_plan_dense_layers_steps_and_overrides():
    cfg = sv.SparseConfig(topk=0.1, dense_layers=(0,), dense_steps=2,
                          layer_overrides={2: {"topk": 0.3, "rule": "topk"}, 3: {"dense": True}})
    assert cfg.plan(0, 5) is None
    assert cfg.plan(1, 0) is None and cfg.plan(1, 1) is None
    plan = cfg.plan(1, 2)
    assert isinstance(plan, LayerPlan) and plan.topk == 0.1 and plan.rule == "hybrid"
    assert cfg.plan(1, None) is not None  # unknown step: not a warm-up step
    assert cfg.plan(2, 7).topk == 0.3 and cfg.plan(2, 7).rule == "topk"
    assert cfg.plan(3, 7) is None
    assert cfg.plan(1, 2).predict_kwargs()["block_q"] == 128


def test_step_counting_follows_timesteps_with_guidance_passes():
    ctx = StepContext()
    steps = []
    for t in (999, 999, 800, 800, 600, 600, 999, 999, 700):
        ctx.begin_forward(torch.tensor([t, t]), (1, 2, 3))
        steps.append(ctx.step)
    assert steps == [0, 0, 1, 1, 2, 2, 0, 0, 1]
    ctx.reset()
    ctx.begin_forward(torch.tensor([100]), None)
    assert ctx.step == 0
    ctx.set_step(5)
    ctx.begin_forward(torch.tensor([50]), None)
    assert ctx.step == 5
    ctx.set_step(None)
    ctx.begin_forward(torch.tensor([20]), None)
    assert ctx.step == 6
    with pytest.raises(ValueError, match="step"):
        ctx.set_step(-1)


def test_per_token_timesteps_use_the_largest():
    ctx = StepContext()
    ctx.begin_forward(torch.tensor([[0.0, 900.0, 900.0]]), None)
    ctx.begin_forward(torch.tensor([[0.0, 700.0, 700.0]]), None)
    assert ctx.step == 1 and ctx.timestep == 700.0


def test_mask_settings_take_the_predictor_defaults_and_plans_carry_predict_settings():
    defaults = PredictSettings()
    cfg = sv.SparseConfig()
    for setting in MASK_SETTINGS:
        if "predict" in setting.uses:
            assert getattr(cfg, setting.name) == setting.default == getattr(defaults, setting.name), setting.name
    plan = sv.SparseConfig(rule="topk", topk=3, backend="gather", keep_sink=True).plan(0, 0)
    assert plan.predict_settings == PredictSettings(rule="topk", topk=3, keep_sink=True, backend="reference")
    assert plan.predict_kwargs() == {k: getattr(plan.predict_settings, k) for k in plan.predict_kwargs()}
    # A count and a fraction of equal value stay apart.
    assert isinstance(sv.SparseConfig(rule="topk", topk=1).plan(0, 0).predict_settings.topk, int)
    assert isinstance(sv.SparseConfig(rule="topk", topk=1.0).plan(0, 0).predict_settings.topk, float)


def test_a_plan_that_keeps_every_tile_warns_once_over_layers_and_steps():
    forget_warnings()
    cfg = sv.SparseConfig(rule="topk", topk=1000, block_q=64, block_k=64, backend="reference")
    runtimes = [LayerRuntime(layer, cfg) for layer in range(3)]
    q = torch.randn(1, 2, 640, 16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            for runtime in runtimes:
                runtime.begin(StepPosition(step=step))
                assert bool(runtime.mask(q, q, None).keep.all())
    messages = [str(w.message) for w in caught if "0% sparsity" in str(w.message)]
    assert len(messages) == 1 and "topk=1000" in messages[0] and "10 key blocks" in messages[0]
    forget_warnings()


def test_runtimes_keep_a_count_topk_apart_from_an_equal_fraction():
    q = torch.randn(1, 2, 640, 16)
    count, fraction = (LayerRuntime(0, sv.SparseConfig(rule="topk", topk=topk, block_q=64, block_k=64,
                                                       backend="reference")) for topk in (1, 1.0))
    assert bool(count.mask(q, q, 0.25).keep.sum(-1).eq(1).all())
    assert bool(fraction.mask(q, q, 0.25).keep.all())
