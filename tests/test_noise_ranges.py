"""Per-head calibration by noise level: SparseConfig.noise_overrides, the joint allocation over noise ranges,
NoiseRangeCalibration and ``sparsevid calibrate --noise-splits``."""
import itertools

import pytest
import torch

import sparsevid as sv
from sparsevid.plan.calibration import Calibration, Candidate, allocate_sparsity
from sparsevid.plan.noise_ranges import NoiseRangeCalibration, load_calibration

pytest.importorskip("diffusers")
from tiny_models import build, relative_error, run_model  # noqa: E402

from sparsevid.cli import main  # noqa: E402
from sparsevid.eval.calibrate import calibrate_heads  # noqa: E402

BLOCKS = {"block_q": 64, "block_k": 64}
HIGH_NOISE_DENSE = [{"noise_range": [0.5, 1.0], "layer_overrides": {i: {"dense": True} for i in range(3)}}]


# --------------------------------------------------------------------------- the configuration

def test_a_plan_follows_the_noise_range_of_its_step():
    config = sv.SparseConfig(topk=0.5, layer_overrides={0: {"topk": 0.4}}, noise_overrides=[
        {"noise_range": [0.6, 1.0], "layer_overrides": {0: {"dense": True}}},
        {"noise_range": [0.0, 0.3], "layer_overrides": {0: {"topk": 0.25}, "2": {"topk": 0.1}}}])
    assert config.varies_with_step and config.follows_timestep
    assert config.plan(0, 3, 1000.0) is None and config.plan(0, 3, 600.0) is None  # [0.6, 1] includes both ends
    assert config.plan(0, 3, 299.0).topk == 0.25 and config.plan(2, 3, 0.0).topk == 0.1
    assert config.plan(0, 3, 450.0).topk == 0.4  # between the ranges: layer_overrides
    assert config.plan(0, None, None).topk == 0.4  # no timestep: layer_overrides
    assert config.plan(1, 3, 900.0).topk == 0.5  # a layer the range does not name keeps its own setting
    assert sv.SparseConfig.from_json(config.to_json()) == config
    scaled = sv.SparseConfig(topk=0.5, num_train_timesteps=1.0, noise_overrides=[
        {"noise_range": [0.5, 1.0], "layer_overrides": {0: {"dense": True}}}])
    assert scaled.plan(0, 0, 0.7) is None and scaled.plan(0, 0, 0.2) is not None


@pytest.mark.parametrize("entries, message", [
    ({"noise_range": [0, 1]}, "noise_overrides must be a list"),
    ([{"noise_range": [0, 1]}], r"noise_overrides\[0\] must be"),
    ([{"noise_range": [0.5, 0.2], "layer_overrides": {}}], r"noise_overrides\[0\].noise_range must be"),
    ([{"noise_range": [0, 1.5], "layer_overrides": {}}], "0 <= low < high <= 1"),
    ([{"noise_range": [0, 0.6], "layer_overrides": {}}, {"noise_range": [0.5, 1], "layer_overrides": {}}],
     r"ranges \[0.0, 0.6\] and \[0.5, 1.0\] overlap"),
    ([{"noise_range": [0, 1], "layer_overrides": {0: {"topq": 1}}}],
     r"noise_overrides\[0\].layer_overrides\[0\] has unknown fields \['topq'\]"),
    ([{"noise_range": [0, 1], "layer_overrides": {0: {"topk": 1.5}}}],
     r"noise_overrides\[0\].layer_overrides\[0\].topk"),
])
def test_bad_noise_overrides_are_refused(entries, message):
    with pytest.raises((ValueError, TypeError), match=message):
        sv.SparseConfig(noise_overrides=entries)


def test_a_noise_range_naming_a_layer_the_model_lacks_or_the_wrong_head_count_is_refused():
    model, _ = build("wan")  # 3 layers of 2 heads
    with pytest.raises(ValueError, match=r"noise_overrides\[0\].layer_overrides names layers \[5\]"):
        sv.apply_sparse_attention(model, sv.SparseConfig(noise_overrides=[
            {"noise_range": [0, 1], "layer_overrides": {5: {"topk": 0.5}}}]))
    with pytest.raises(ValueError, match="topk gives 3 per-head values, but the layer has 2 heads"):
        sv.apply_sparse_attention(model, sv.SparseConfig(noise_overrides=[
            {"noise_range": [0, 1], "layer_overrides": {1: {"topk": [0.5, 0.5, 0.5]}}}]))


def test_a_sparse_model_switches_its_layers_with_the_noise_level_eager_and_compiled():
    torch.manual_seed(0)
    model, inputs = build("wan")
    at = {t: {**inputs, "timestep": torch.tensor([t])} for t in (900, 200)}
    dense = {t: run_model(model, x) for t, x in at.items()}
    plain = sv.SparseConfig(rule="topk", topk=0.25, backend="reference", **BLOCKS)
    sv.apply_sparse_attention(model, plain)
    sparse = {t: run_model(model, x) for t, x in at.items()}
    sv.remove_sparse_attention(model)
    sv.apply_sparse_attention(model, sv.SparseConfig(**{**plain.to_dict(), "noise_overrides": HIGH_NOISE_DENSE}))
    eager = {t: run_model(model, x) for t, x in at.items()}
    assert relative_error(sparse[200], dense[200]) > 1e-3  # the sparse layers did change the output
    assert relative_error(eager[900], dense[900]) < 1e-6  # high noise: every layer dense
    assert relative_error(eager[200], sparse[200]) < 1e-6  # low noise: the sparse plan
    compiled = torch.compile(model, backend="aot_eager")
    for generation in range(2):  # the second generation meets only plans compiled for in the first
        sv.reset_denoising_step(model)
        with torch._dynamo.config.patch(error_on_recompile=generation == 1):
            for t, x in at.items():
                assert relative_error(run_model(compiled, x), eager[t]) < 1e-5


# --------------------------------------------------------------------------- the allocation

@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("target", [0.35, 0.6])
def test_a_weighted_allocation_reaches_the_weighted_target_near_the_best_assignment(seed, target):
    generator = torch.Generator().manual_seed(seed)
    sparsity = torch.rand(2, 2, 4, generator=generator, dtype=torch.float64).sort(dim=-1).values
    sparsity[..., 0] = 0.0
    error = sparsity ** 2 * torch.rand(2, 2, 1, generator=generator, dtype=torch.float64) * 2
    weights = torch.tensor([[0.7, 0.7], [0.3, 0.3]], dtype=torch.float64)  # two ranges of one layer, 70/30 calls
    choice = allocate_sparsity(error, sparsity, target, weights)

    def weighted(picks):
        return (float((sparsity.gather(-1, picks.unsqueeze(-1)).squeeze(-1) * weights).sum() / weights.sum()),
                float((error.gather(-1, picks.unsqueeze(-1)).squeeze(-1) * weights).sum()))

    achieved, total = weighted(choice)
    reachable, _ = weighted(sparsity.argmax(dim=-1))
    if target > reachable:  # out of reach: the sparsest choice
        assert achieved == pytest.approx(reachable, abs=1e-12)
        return
    assert achieved >= target - 1e-12
    best = min(cost for mean, cost in (weighted(torch.tensor(p).view(2, 2))
                                       for p in itertools.product(range(4), repeat=4)) if mean >= target - 1e-12)
    assert best <= total <= best + float((error * weights.unsqueeze(-1)).max())
    assert torch.equal(allocate_sparsity(error, sparsity, target, torch.ones(2, 2, dtype=torch.float64)),
                       allocate_sparsity(error, sparsity, target))


def _range_calibration(error: list, calls: int) -> Calibration:
    """One layer of two heads; candidates dense, top-k 0.5, top-k 0.25 at sparsity 0, 0.5, 0.75."""
    candidates = (Candidate("dense"), Candidate("topk", 0.5), Candidate("topk", 0.25))
    table = [[[0.0, 0.5, 0.75]] * 2]
    return Calibration({"family": "wan", "class_name": "WanTransformer3DModel", "heads": [2]},
                       {"block_q": 64, "block_k": 64, "tile": "auto"}, candidates, table, [error],
                       [[[1.0, 0.8, 0.6]] * 2], inputs={"calls_per_layer": [calls]})


def test_the_budget_goes_to_the_noise_range_whose_heads_lose_least():
    low = _range_calibration([[0.0, 0.01, 0.02], [0.0, 0.01, 0.02]], calls=2)  # sparsity costs little here
    high = _range_calibration([[0.0, 0.3, 0.9], [0.0, 0.3, 0.9]], calls=2)
    ranged = NoiseRangeCalibration((0.5,), [low, high])
    assert ranged.weights() == [0.5, 0.5] and ranged.bounds == [(0.0, 0.5), (0.5, 1.0)]
    choice = ranged.allocate(target_sparsity=0.5, error="relative")
    # the cheap range takes 75% in both heads, so that the other can keep one head dense (mean 50%, summed error
    # 0.34 against 0.64 for 50% everywhere)
    assert choice[0] == [[2, 2]] and sorted(choice[1][0]) == [0, 1]
    ranged.choose(target_sparsity=0.5, error="relative")
    assert ranged.summary()["mean_sparsity"] == pytest.approx(0.5)
    pooled = ranged.pooled()  # every call alike: the mean of the two ranges' tables
    assert pooled.error[0][0] == pytest.approx([0.0, 0.155, 0.46]) and pooled.inputs["calls_per_layer"] == [4]
    config = ranged.config()
    assert [entry["noise_range"] for entry in config.noise_overrides] == [(0.0, 0.5), (0.5, 1.0)]
    assert config.plan(0, 0, 100.0).topk == 0.25 and sorted(config.plan(0, 0, 900.0).topk) == [0.5, 1.0]
    assert config.layer_overrides == pooled.config(target_sparsity=0.5, error="relative").layer_overrides
    with pytest.raises(ValueError, match="num_train_timesteps"):
        ranged.config(num_train_timesteps=1.0)
    with pytest.raises(ValueError, match="3 noise splits make 4 ranges"):
        NoiseRangeCalibration((0.2, 0.5, 0.7), [low, high])
    with pytest.raises(ValueError, match="strictly ascending within"):
        NoiseRangeCalibration((1.5,), [low, high])


# --------------------------------------------------------------------------- measuring by noise range

@pytest.fixture(scope="module")
def ranged():
    """A tiny Wan measured at two noise levels, split at 0.5, and the same forwards measured without splits."""
    torch.manual_seed(0)
    model, inputs = build("wan")
    forwards = [lambda t=t: model(**{**inputs, "timestep": torch.tensor([t])}) for t in (900, 300, 700)]
    return (calibrate_heads(model, forwards, backend="reference", noise_splits=(0.5,), **BLOCKS),
            calibrate_heads(model, forwards, backend="reference", **BLOCKS))


def test_each_call_is_measured_in_the_range_of_its_noise_level_and_the_pool_is_the_unsplit_calibration(ranged):
    split, whole = ranged
    assert split.calls() == [[1, 1, 1], [2, 2, 2]] and split.weights() == pytest.approx([1 / 3, 2 / 3])
    pooled = split.pooled()
    for name in ("sparsity", "error", "abs_error", "output_error", "recall"):
        assert torch.tensor(getattr(pooled, name)) == pytest.approx(torch.tensor(getattr(whole, name)), abs=1e-9)
    # the two ranges did see different attention
    assert split.ranges[0].error != split.ranges[1].error


def test_a_calibration_by_noise_range_round_trips_through_its_file(ranged, tmp_path):
    split, _ = ranged
    split.choose(target_sparsity=0.5)
    assert split.objective == {"target_sparsity": 0.5, "error": "output"}
    path = split.save(tmp_path / "calibration.json")
    loaded = load_calibration(path)
    assert isinstance(loaded, NoiseRangeCalibration) and loaded.splits == (0.5,)
    assert [r.choice for r in loaded.ranges] == [r.choice for r in split.ranges]
    assert sv.SparseConfig.from_calibration(path) == split.config()
    assert sv.SparseConfig.from_calibration(path, target_sparsity=0.7) == split.config(target_sparsity=0.7)
    with pytest.raises(ValueError, match="measured by noise range: read it with"):
        Calibration.load(path)


def test_a_noise_range_the_forwards_never_reach_merges_into_its_neighbours():
    """E.g. the levels one expert of a two-expert pipeline does not serve: forwards at 0.9 and 0.6 leave [0, 0.3) and
    [0.3, 0.5) empty; what remains is [0, 0.7) (measured at 0.6) and [0.7, 1]."""
    torch.manual_seed(0)
    model, inputs = build("wan")
    forwards = [lambda t=t: model(**{**inputs, "timestep": torch.tensor([t])}) for t in (900, 600)]
    merged = calibrate_heads(model, forwards, backend="reference", noise_splits=(0.3, 0.5, 0.7), **BLOCKS)
    assert merged.splits == (0.7,) and merged.calls() == [[1, 1, 1], [1, 1, 1]]
    one = calibrate_heads(model, forwards[:1], backend="reference", noise_splits=(0.5,), **BLOCKS)
    assert isinstance(one, Calibration) and one.inputs["calls_per_layer"] == [1, 1, 1]  # a single range reached
    with pytest.raises(ValueError, match="no video self-attention call was measured in layers"):
        calibrate_heads(model, [], backend="reference", noise_splits=(0.5,), **BLOCKS)
    with pytest.raises(ValueError, match="strictly ascending"):
        calibrate_heads(model, [], noise_splits=(0.5, 0.2))


def test_the_command_calibrates_by_noise_range(tmp_path, capsys):
    from sparsevid.training import ShardWriter, write_null_text

    model, inputs = build("wan")
    model.save_pretrained(tmp_path / "transformer")
    with ShardWriter(tmp_path / "latents", {"family": "wan"}) as writer:
        for i in range(4):
            writer.add(torch.randn(4, 4, 16, 20), torch.randn(12, 16), metadata={"source": f"sample{i}"})
    write_null_text(tmp_path / "latents", torch.zeros(12, 16))
    out = tmp_path / "calibration.json"
    assert main(["calibrate", "--model", str(tmp_path / "transformer"), "--data", str(tmp_path / "latents"),
                 "--target-sparsity", "0.6", "--noise-splits", "0.5", "--block-q", "64", "--block-k", "64",
                 "--per-bin", "1", "--bins", "2", "--device", "cpu", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "noise levels [0, 0.5) (50% of the calls)" in printed and "noise levels [0.5, 1] (50%" in printed
    calibration = load_calibration(out)
    assert calibration.calls() == [[1, 1, 1], [1, 1, 1]] and calibration.summary()["mean_sparsity"] >= 0.6
    assert all(r.inputs["seconds"] > 0 for r in calibration.ranges) and out.with_suffix(".png").stat().st_size > 0
    sv.apply_sparse_attention(model, sv.SparseConfig.from_calibration(out))
    assert torch.isfinite(run_model(model, inputs)).all()
    with pytest.raises(SystemExit):
        main(["calibrate", "--model", str(tmp_path / "transformer"), "--data", str(tmp_path / "latents"),
              "--target-sparsity", "0.6", "--noise-splits", "0.7,0.3"])
    assert "noise levels S1,S2,... strictly ascending within (0, 1)" in capsys.readouterr().err
