"""Per-head calibration (``sparsevid calibrate``, ``SparseConfig.from_calibration``): the measurements and the
allocation, the file round trip, per-head budgets in the predictor (eager, compiled, a rank's slice of heads),
refusal of another model's calibration, and the command end to end on a tiny saved Wan (float32, CPU)."""
import itertools
import json

import pytest
import torch

import sparsevid as sv
from sparsevid.plan import LayerRuntime
from sparsevid.plan.calibration import Calibration, Candidate, allocate_error, allocate_sparsity, default_candidates

pytest.importorskip("diffusers")
from tiny_models import MODELS, build, relative_error, run_model  # noqa: E402

from sparsevid.cli import main  # noqa: E402
from sparsevid.cli.calibrate import CALIBRATION_PROMPTS  # noqa: E402
from sparsevid.eval.calibrate import calibrate_heads  # noqa: E402
from sparsevid.integration import adapter_for  # noqa: E402
from sparsevid.integration.adapters import attention_heads  # noqa: E402

BLOCKS = {"block_q": 64, "block_k": 64}


@pytest.fixture(scope="module")
def calibration():
    """A tiny Wan (3 layers of 2 heads, 320 tokens: 5 x 5 tiles) measured on two forwards."""
    torch.manual_seed(0)
    model, inputs = build("wan")
    forwards = [lambda: model(**inputs), lambda: model(**{**inputs, "timestep": torch.tensor([300])})]
    return calibrate_heads(model, forwards, backend="reference", **BLOCKS)


def _tiny_wan():
    torch.manual_seed(0)
    return build("wan")


# --------------------------------------------------------------------------- measurements and allocation

def test_measurements_are_per_head_and_the_dense_candidate_is_exact(calibration):
    assert calibration.model == {"family": "wan", "class_name": "WanTransformer3DModel", "heads": [2, 2, 2]}
    assert calibration.inputs["calls_per_layer"] == [2, 2, 2]
    dense = [c.rule for c in calibration.candidates].index("dense")
    for name, expected in (("sparsity", 0.0), ("error", 0.0), ("recall", 1.0)):
        assert all(row[dense] == expected for layer in getattr(calibration, name) for row in layer)
    # 5 key blocks: top-k 0.5 keeps ceil(2.5) = 3 of them in every row, 40% sparsity, whatever the scores.
    half = calibration.candidates.index(Candidate("topk", 0.5))
    assert all(row[half] == pytest.approx(0.4, abs=1e-12) for layer in calibration.sparsity for row in layer)
    # Sparser masks of one rule keep less mass; every sparse head loses some output.
    topk = [i for i, c in enumerate(calibration.candidates) if c.rule == "topk"]
    for layer in calibration.recall:
        for row in layer:
            assert all(row[a] >= row[b] - 1e-12 for a, b in itertools.pairwise(topk))
    assert all(row[half] > 0 for layer in calibration.error for row in layer)


def _brute_force(error, sparsity, target):
    """The least summed error at mean sparsity >= target over every assignment (tiny tables only)."""
    layers, heads, candidates = error.shape
    best = None
    for picks in itertools.product(range(candidates), repeat=layers * heads):
        choice = torch.tensor(picks).view(layers, heads, 1)
        if sparsity.gather(-1, choice).mean() >= target - 1e-12:
            total = float(error.gather(-1, choice).sum())
            best = total if best is None else min(best, total)
    return best


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("target", [0.3, 0.55, 0.8])
def test_sparsity_allocation_reaches_the_target_near_the_best_assignment(seed, target):
    generator = torch.Generator().manual_seed(seed)
    sparsity = torch.rand(2, 2, 4, generator=generator, dtype=torch.float64).sort(dim=-1).values
    sparsity[..., 0] = 0.0  # dense
    error = sparsity ** 2 * torch.rand(2, 2, 1, generator=generator, dtype=torch.float64) * 2
    choice = allocate_sparsity(error, sparsity, target)
    achieved = float(sparsity.gather(-1, choice.unsqueeze(-1)).mean())
    reachable = float(sparsity.max(dim=-1).values.mean())
    if target > reachable:  # out of reach: the sparsest choice
        assert achieved == pytest.approx(reachable, abs=1e-12)
        return
    assert achieved >= target - 1e-12
    # The Lagrangian solution is optimal on the lower convex hull of each head; with 4 heads the remaining gap
    # to the exhaustive optimum stays within the error of one head's step.
    best = _brute_force(error, sparsity, target)
    total = float(error.gather(-1, choice.unsqueeze(-1)).sum())
    assert best <= total <= best + float(error.max())


def test_error_bound_takes_each_heads_sparsest_setting_within_it():
    sparsity = torch.tensor([[[0.0, 0.5, 0.7, 0.9], [0.0, 0.6, 0.8, 0.95]]], dtype=torch.float64)
    error = torch.tensor([[[0.0, 0.01, 0.05, 0.2], [0.0, 0.2, 0.3, 0.4]]], dtype=torch.float64)
    assert allocate_error(error, sparsity, 0.06).tolist() == [[2, 0]]
    assert allocate_error(error, sparsity, 1.0).tolist() == [[3, 3]]


@pytest.mark.parametrize("target, kept", [(0.9375, 4), (0.953125, 3)])
def test_global_top_k_reaches_the_sparsities_of_whole_key_block_counts(target, kept):
    # 4,096 tokens in 64 key blocks: keeping 1 - target of them is exactly `kept` blocks per row.
    q, k = torch.randn(2, 1, 2, 4096, 16).unbind(0)
    config = sv.eval.calibrate_rules([(q, k)], [target], block_q=128, block_k=64)[f"topk {target:.0%}"]
    mask, _ = sv.predict_mask(q, k, rule="topk", topk=config.topk, block_q=128, block_k=64)
    assert mask.to_dense().sum(-1).unique().tolist() == [kept]
    assert mask.sparsity == pytest.approx(target, abs=1e-9)


@pytest.mark.parametrize("objective, message", [
    ({}, "exactly one"), ({"target_sparsity": 0.5, "max_error": 0.1}, "exactly one"),
    ({"target_sparsity": 1.0}, "target_sparsity"), ({"max_error": -0.1}, "max_error")])
def test_bad_objectives_are_refused(calibration, objective, message):
    with pytest.raises(ValueError, match=message):
        calibration.allocate(**objective)


# --------------------------------------------------------------------------- the file

def test_calibration_round_trips_through_the_file(calibration, tmp_path):
    calibration.choose(target_sparsity=0.5)
    path = calibration.save(tmp_path / "calibration.json")
    loaded = Calibration.load(path)
    assert loaded.choice == calibration.choice and loaded.objective == {"target_sparsity": 0.5, "error": "output"}
    assert loaded.candidates == calibration.candidates and loaded.model == calibration.model
    for name in ("sparsity", "error", "abs_error", "output_error", "recall"):  # stored to 6 decimals
        assert torch.allclose(torch.tensor(getattr(loaded, name)), torch.tensor(getattr(calibration, name)),
                              atol=5e-7, rtol=0)
    config = sv.SparseConfig.from_calibration(path, backend="reference")
    assert config == calibration.config(backend="reference")
    assert sv.SparseConfig.from_json(config.to_json()) == config
    assert config.calibrated_for == {"family": "wan", "heads": [2, 2, 2]}
    # A new target chosen from the stored measurements, without running the model again.
    sparser = sv.SparseConfig.from_calibration(path, target_sparsity=0.8)
    assert sparser.layer_overrides != config.layer_overrides


def test_a_target_allocates_on_the_output_errors_by_default_where_they_were_measured(calibration, tmp_path):
    """The default error: "output" for a target sparsity; "relative" for an error bound and for a file measured
    before the output errors (which then allocates as it did)."""
    output = calibration.allocate(target_sparsity=0.6, error="output")
    relative = calibration.allocate(target_sparsity=0.6, error="relative")
    assert output != relative  # the tiny Wan's heads rank differently on the two errors
    assert calibration.allocate(target_sparsity=0.6) == output
    assert calibration.allocate(max_error=0.1) == calibration.allocate(max_error=0.1, error="relative")
    calibration.choose(target_sparsity=0.6)
    path = calibration.save(tmp_path / "calibration.json")
    assert sv.SparseConfig.from_calibration(path) == calibration.config(target_sparsity=0.6, error="output")
    older = json.loads(path.read_text())
    del older["output_error"]
    (tmp_path / "older.json").write_text(json.dumps(older))
    assert Calibration.load(tmp_path / "older.json").allocate(target_sparsity=0.6) == relative
    calibration.choose(target_sparsity=0.5)


def test_absolute_errors_weigh_each_head_by_the_size_of_its_output(calibration, tmp_path):
    """abs_error = error x the head's mean |output|; allocating on it is the relative allocation with every head's
    errors scaled by its output size, and a calibration without it (an older file) refuses error='absolute'."""
    dense = [c.rule for c in calibration.candidates].index("dense")
    half = calibration.candidates.index(Candidate("topk", 0.5))
    relative, absolute = torch.tensor(calibration.error), torch.tensor(calibration.abs_error)
    assert (absolute[..., dense] == 0).all() and (absolute[..., half] > 0).all()
    size = absolute[..., half] / relative[..., half]  # [L, H]: each head's mean |output|, the same for every candidate
    sparse = [i for i, c in enumerate(calibration.candidates) if c.rule != "dense"]
    assert torch.allclose(absolute[..., sparse], relative[..., sparse] * size.unsqueeze(-1), rtol=1e-3, atol=1e-6)
    scaled = allocate_sparsity((relative * size.unsqueeze(-1)).double(), torch.tensor(calibration.sparsity).double(),
                               0.6)
    assert calibration.allocate(target_sparsity=0.6, error="absolute") == scaled.tolist()
    calibration.choose(target_sparsity=0.6, error="absolute")
    assert calibration.objective == {"target_sparsity": 0.6, "error": "absolute"}
    path = calibration.save(tmp_path / "calibration.json")
    assert sv.SparseConfig.from_calibration(path, target_sparsity=0.6, error="absolute") == calibration.config()
    older = json.loads(path.read_text())
    del older["abs_error"]
    (tmp_path / "older.json").write_text(json.dumps(older))
    with pytest.raises(ValueError, match="absolute errors"):
        sv.SparseConfig.from_calibration(tmp_path / "older.json", target_sparsity=0.6, error="absolute")
    with pytest.raises(ValueError, match="error must be one of"):
        calibration.allocate(target_sparsity=0.6, error="squared")
    calibration.choose(target_sparsity=0.5)


def test_output_errors_are_each_heads_error_through_its_slice_of_the_output_projection():
    """HeadMeter's output error of a head is ||(o_c - o)_h W_h^T|| / ||o W^T|| (W the layer's output projection
    [C, H * D], W_h the columns of head h), computed here directly from the candidate's mask."""
    from sparsevid.eval.calibrate import HeadMeter

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 320, 16, dtype=torch.float64) for _ in range(3))
    weight = torch.randn(24, 32, dtype=torch.float64)
    candidate = Candidate("topk", 0.35)
    meter = HeadMeter([2], [Candidate("dense"), candidate], backend="reference", **BLOCKS)
    meter.add(0, q, k, v, projection=weight)
    measured = torch.tensor(meter.means()["output_error"][0])
    topk, topp = candidate.budgets
    mask, _ = sv.predict_mask(q, k, rule="hybrid", topk=topk, topp=topp, **BLOCKS)
    diff = sv.block_sparse_attention(q, k, v, mask, backend="reference") - torch.nn.functional.scaled_dot_product_attention(q, k, v)
    dense = torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2) @ weight.T
    for head in range(2):
        expected = (diff[:, head] @ weight[:, head * 16:(head + 1) * 16].T).norm() / dense.norm()
        assert measured[head, 1] == pytest.approx(float(expected), rel=1e-9)
    assert (measured[:, 0] == 0).all()
    with pytest.raises(ValueError, match="projection must be a weight"):
        meter.add(0, q, k, v, projection=weight[:, :16])


def test_a_single_stream_attention_is_projected_through_its_share_of_the_blocks_proj_out():
    """HunyuanVideo's single-stream blocks concatenate the attention output with the MLP's before one ``proj_out``:
    the attention's output projection is that weight's first H * D columns; dual-stream blocks have their own."""
    from sparsevid.eval.calibrate import _output_projections

    model, _ = build("hunyuan_video")
    adapter = adapter_for(model)
    layer_of = {id(attention): i for i, attention in enumerate(adapter.self_attentions(model))}
    weights = _output_projections(model, adapter)
    single, dual = model.single_transformer_blocks[0], model.transformer_blocks[0]
    inner = single.attn.to_q.out_features
    assert single.proj_out.weight.shape[1] > inner
    assert torch.equal(weights[layer_of[id(single.attn)]], single.proj_out.weight[:, :inner])
    assert weights[layer_of[id(dual.attn)]] is dual.attn.to_out[0].weight


def test_a_head_without_output_projection_weight_takes_the_sparsest_setting():
    """A head whose slice of to_out is zero moves nothing: its output error is 0 for every candidate, so the
    "output" allocation gives it the sparsest one; scaling another head's slice up 10x scales its error up against
    its layer's other head and moves it to denser settings."""
    model, inputs = _tiny_wan()
    with torch.no_grad():
        model.blocks[0].attn1.to_out[0].weight[:, :model.blocks[0].attn1.to_out[0].weight.shape[1] // 2] = 0
    forwards = [lambda: model(**inputs)]
    calibration = calibrate_heads(model, forwards, backend="reference", **BLOCKS)
    output = torch.tensor(calibration.output_error)
    assert (output[0, 0] == 0).all()
    assert torch.equal(output[0, 1] > 0, torch.tensor(calibration.error)[0, 1] > 0)  # where the head's output moves
    sparsest = int(torch.tensor(calibration.sparsity)[0, 0].argmax())
    choice = calibration.allocate(target_sparsity=0.2, error="output")
    assert choice[0][0] == sparsest and calibration.allocate(target_sparsity=0.2, error="relative")[0][0] != sparsest
    with torch.no_grad():
        model.blocks[2].attn1.to_out[0].weight[:, 12:] *= 10  # head 1 of layer 2 moves its layer 10x more
    louder = calibrate_heads(model, forwards, backend="reference", **BLOCKS)
    # Layer 2's q, k, v are unchanged: head 1's error grows 10x against head 0's (one denominator for both).
    moved = torch.tensor(calibration.error)[2, 0] > 0
    before, after = output[2][:, moved], torch.tensor(louder.output_error)[2][:, moved]
    assert torch.allclose(after[1] / after[0], 10 * before[1] / before[0], rtol=1e-6)
    sparsity = torch.tensor(calibration.sparsity)[2, 1]
    picked = [[float(sparsity[c.allocate(target_sparsity=s, error="output")[2][1]]) for s in (0.3, 0.5, 0.7)]
              for c in (calibration, louder)]
    assert all(a <= b for a, b in zip(picked[1], picked[0])) and picked[1] != picked[0]  # denser for head 1

def test_the_loaded_configuration_achieves_the_chosen_sparsity(calibration):
    calibration.choose(target_sparsity=0.6)
    summary = calibration.summary()
    assert summary["mean_sparsity"] >= 0.6
    model, inputs = _tiny_wan()
    sv.apply_sparse_attention(model, calibration.config(backend="reference"), collect_stats=True)
    with torch.no_grad():
        model(**inputs)
    # Sparsity measured on the same input as one of the two calibration forwards: top-k heads reach exactly their
    # share whatever the input; top-p heads follow the scores (compared with the two-forward mean loosely).
    for layer, stats in enumerate(sv.attention_stats(model)):
        expected = sum(summary["sparsity"][layer]) / 2
        assert stats["sparsity"] == pytest.approx(expected, abs=0.15)


@pytest.mark.parametrize("change, message", [
    (lambda d: d.update(format="other"), "not a sparsevid calibration"),
    (lambda d: d.update(version=99), "version 99"),
    (lambda d: d["error"].pop(), "error must be a"),
])
def test_a_bad_file_is_refused(calibration, tmp_path, change, message):
    data = calibration.to_dict()
    change(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=message):
        Calibration.load(path)
    with pytest.raises(FileNotFoundError, match="no calibration file"):
        Calibration.load(tmp_path / "missing.json")


# --------------------------------------------------------------------------- per-head budgets in the predictor

def _qk(heads=2, tokens=320, dim=16):
    return torch.randn(1, heads, tokens, dim), torch.randn(1, heads, tokens, dim)


def _mask(config, q, k, heads=None):
    return LayerRuntime(0, config).mask(q, k, None, heads).keep


def test_a_per_head_setting_changes_exactly_the_heads_it_names():
    q, k = _qk(heads=3)
    scalar = sv.SparseConfig(rule="hybrid", topk=0.3, topp=0.5, backend="reference", **BLOCKS)
    same = sv.SparseConfig(rule="hybrid", topk=[0.3] * 3, topp=[0.5] * 3, backend="reference", **BLOCKS)
    torch.testing.assert_close(_mask(same, q, k), _mask(scalar, q, k), rtol=0, atol=0)
    one = sv.SparseConfig(rule="hybrid", layer_overrides={0: {"topk": [0.3, 0.8, 0.3], "topp": [0.5, 0.5, 0.5]}},
                          topp=0.5, backend="reference", **BLOCKS)
    keep, reference = _mask(one, q, k), _mask(scalar, q, k)
    assert torch.equal(keep[:, [0, 2]], reference[:, [0, 2]])
    assert keep[:, 1].sum() > reference[:, 1].sum()
    # A dense head (topk = topp = 1) keeps every tile; a top-p head with topk off keeps its top-p set.
    mixed = sv.SparseConfig(rule="hybrid", topk=[1.0, 1e-6, 0.3], topp=[1.0, 0.5, 1e-6], backend="reference",
                            **BLOCKS)
    keep = _mask(mixed, q, k)
    topp_only = _mask(sv.SparseConfig(rule="topp", topp=0.5, backend="reference", **BLOCKS), q, k)
    topk_only = _mask(sv.SparseConfig(rule="topk", topk=0.3, backend="reference", **BLOCKS), q, k)
    assert keep[:, 0].all() and torch.equal(keep[:, 1], topp_only[:, 1]) and torch.equal(keep[:, 2], topk_only[:, 2])


def test_a_ranks_slice_of_heads_uses_its_own_budgets():
    """Under Ulysses context parallelism a rank holds the whole sequence of some heads: its masks are the
    single-device masks of those heads."""
    q, k = _qk(heads=3)
    config = sv.SparseConfig(rule="hybrid", topk=[0.2, 0.5, 0.8], topp=[0.3, 0.6, 0.9], backend="reference", **BLOCKS)
    whole = _mask(config, q, k)
    for heads in (range(2), range(2, 3)):
        part = _mask(config, q[:, heads.start:heads.stop], k[:, heads.start:heads.stop], heads)
        assert torch.equal(part, whole[:, heads.start:heads.stop])
    with pytest.raises(ValueError, match="3 per-head budgets"):
        _mask(config, q[:, :2], k[:, :2], range(2, 4))


@pytest.mark.slow  # compiling a tiny Wan takes 20-60 s on a CPU
def test_compiled_per_head_model_matches_eager_in_one_graph(calibration):
    calibration.choose(target_sparsity=0.5)
    model, inputs = _tiny_wan()
    sv.apply_sparse_attention(model, calibration.config(backend="reference"))
    with torch.no_grad():
        eager = model(**inputs, return_dict=False)[0]
        dense_model, _ = _tiny_wan()
        dense = dense_model(**inputs, return_dict=False)[0]
        torch._dynamo.reset()
        graphs = []

        def backend(graph, example_inputs):  # aot_eager, keeping the graph dynamo captured
            from torch._dynamo.backends.debugging import aot_eager

            graphs.append(graph)
            return aot_eager(graph, example_inputs)

        compiled = torch.compile(model, backend=backend, fullgraph=True)
        out = compiled(**inputs, return_dict=False)[0]
    torch._dynamo.reset()
    # Every sparse layer's masks come from a prediction op inside the captured graphs: the per-head op for layers
    # with per-head budgets, the scalar op for layers whose heads all took one setting.
    ops = [node.target for graph in graphs for node in graph.graph.nodes if node.op == "call_function"]
    overrides = calibration.config().layer_overrides.values()
    per_head = sum(isinstance(values.get("topk"), tuple) for values in overrides)
    scalar = sum(not values.get("dense", False) for values in overrides) - per_head
    assert ops.count(torch.ops.sparsevid.predict_mask_per_head.default) == per_head > 0
    assert ops.count(torch.ops.sparsevid.predict_mask.default) == scalar
    assert float((eager - dense).norm() / dense.norm()) > 1e-3  # the masks drop tiles
    # The same masks and kernels, traced: equal up to float32 reassociation.
    assert float((out - eager).norm() / eager.norm()) < 1e-5


@pytest.mark.slow  # compiling takes 5-20 s per tiny model on a CPU
@pytest.mark.parametrize("name", ["cogvideox", "mochi"])  # joint attention; joint with the batch packed (Wan: above)
def test_per_head_budgets_compile_like_eager_in_other_families(name):
    """Per-head budgets of every layer (each head its own top-k share) under torch.compile give eager's output."""
    model, inputs = build(name)
    heads = {attention_heads(a) for a in adapter_for(model).self_attentions(model)}
    assert len(heads) == 1, "the tiny models have as many heads in every layer"
    count = heads.pop()
    topk = tuple(round(0.25 + 0.5 * h / max(1, count - 1), 3) for h in range(count))
    sv.apply_sparse_attention(model, sv.SparseConfig(rule="hybrid", topk=topk, topp=(1e-6,) * count,
                                                     backend="reference", **BLOCKS))
    torch._dynamo.reset()
    with torch.no_grad():
        eager = run_model(model, inputs)
        compiled = run_model(torch.compile(model, backend="aot_eager"), inputs)
    torch._dynamo.reset()
    assert relative_error(compiled, eager) < 1e-5


# --------------------------------------------------------------------------- another model's calibration

@pytest.mark.parametrize("name, config, message", [
    ("wan", {"num_layers": 2}, "3 self-attention layers; this transformer has 2"),
    ("wan", {"num_attention_heads": 3}, "layer 0 with 2 heads; this transformer's layer 0 has 3"),
    ("chronoedit", {}, "not for a chronoedit transformer"),
])
def test_another_models_calibration_is_refused(calibration, name, config, message):
    calibration.choose(target_sparsity=0.5)
    model, _ = build(name, **config)
    with pytest.raises(ValueError, match=message):
        sv.apply_sparse_attention(model, calibration.config())


def test_per_head_budgets_of_another_length_than_the_heads_are_refused():
    model, _ = build("wan")
    with pytest.raises(ValueError, match="layer 1: topk gives 3 per-head values, but the layer has 2 heads"):
        sv.apply_sparse_attention(model, sv.SparseConfig(layer_overrides={1: {"topk": [0.1, 0.2, 0.3]}}))


@pytest.mark.parametrize("fields, message", [
    ({"topk": [0.1, 1.5]}, r"topk\[1\]"),
    ({"topk": [0.1, 2]}, "all fractions or all counts"),
    ({"topp": []}, "non-empty"),
    ({"topk": [0.1, 0.2], "topp": [0.5, 0.6, 0.7]}, "one value per head"),
    ({"topk": [0.1, 0.2], "schedule": "linear", "final_topp": 0.5, "num_steps": 4}, "constant budget"),
    ({"calibrated_for": {"family": "wan"}}, "calibrated_for"),
])
def test_bad_per_head_fields_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        sv.SparseConfig(**fields)


def test_candidates_check_their_values():
    with pytest.raises(ValueError, match="candidate rule"):
        Candidate("topz", 0.5)
    with pytest.raises(ValueError, match="candidate value"):
        Candidate("topk", 0.0)
    assert default_candidates()[0] == Candidate("dense")


# --------------------------------------------------------------------------- the command

@pytest.fixture(scope="module")
def saved_wan(tmp_path_factory):
    """A tiny Wan transformer folder and six cached latent samples for it."""
    from sparsevid.training import ShardWriter, write_null_text

    root = tmp_path_factory.mktemp("calibrate")
    model, _ = _tiny_wan()
    model.save_pretrained(root / "transformer")
    with ShardWriter(root / "latents", {"family": "wan"}) as writer:
        for i in range(6):
            writer.add(torch.randn(4, 4, 16, 20), torch.randn(12, 16), metadata={"source": f"sample{i}"})
    write_null_text(root / "latents", torch.zeros(12, 16))
    return root


def test_the_command_calibrates_a_saved_tiny_wan_end_to_end(saved_wan, capsys):
    model_dir = saved_wan / "transformer"
    assert main(["calibrate", "--model", str(model_dir), "--data", str(saved_wan / "latents"), "--target-sparsity",
                 "0.6", "--block-q", "64", "--block-k", "64", "--per-bin", "1", "--bins", "2", "--device", "cpu"]) == 0
    printed = capsys.readouterr().out
    assert "all     60.0%" in printed and "sparse_calibration.json" in printed
    assert (model_dir / "sparse_calibration.png").stat().st_size > 0
    calibration = Calibration.load(model_dir / "sparse_calibration.json")
    assert calibration.inputs["calls_per_layer"] == [2, 2, 2] and calibration.inputs["seconds"] > 0
    assert calibration.summary()["mean_sparsity"] >= 0.6
    transformer = sv.integration.load_transformer(model_dir)
    sv.apply_sparse_attention(transformer, sv.SparseConfig.from_calibration(model_dir / "sparse_calibration.json"))
    _, inputs = _tiny_wan()
    with torch.no_grad():
        assert torch.isfinite(transformer(**inputs, return_dict=False)[0]).all()


def test_the_command_calibrates_a_joint_family_from_its_cached_latents(tmp_path):
    """HunyuanVideo 1.5 (joint text-video attention with a text-padding mask, an image and a second text encoder's
    states per sample) through the command, from a folder of its cached inputs."""
    from test_training_families import _family_data

    model, _ = _family_data("hunyuan_video15", tmp_path)
    model.save_pretrained(tmp_path / "transformer")
    out = tmp_path / "calibration.json"
    assert main(["calibrate", "--model", str(tmp_path / "transformer"), "--data", str(tmp_path / "latents_hunyuan_video15"),
                 "--target-sparsity", "0.5", "--block-q", "64", "--block-k", "64", "--per-bin", "1", "--bins", "2",
                 "--device", "cpu", "--out", str(out)]) == 0
    calibration = Calibration.load(out)
    assert calibration.model["family"] == "hunyuan_video15"
    assert set(calibration.inputs["calls_per_layer"]) == {2} and calibration.summary()["mean_sparsity"] >= 0.5


def test_the_command_with_an_error_bound(saved_wan, tmp_path):
    out = tmp_path / "bound.json"
    assert main(["calibrate", "--model", str(saved_wan / "transformer"), "--data", str(saved_wan / "latents"),
                 "--max-error", "0.2", "--block-q", "64", "--block-k", "64", "--per-bin", "1", "--bins", "1",
                 "--out", str(out)]) == 0
    summary = Calibration.load(out).summary()
    assert max(max(layer) for layer in summary["error"]) <= 0.2


def test_the_command_allocates_on_the_errors_it_is_told(saved_wan, tmp_path, capsys):
    base = ["calibrate", "--model", str(saved_wan / "transformer"), "--data", str(saved_wan / "latents"),
            "--block-q", "64", "--block-k", "64", "--per-bin", "1", "--bins", "1", "--error", "output"]
    out = tmp_path / "output.json"
    assert main(base + ["--target-sparsity", "0.6", "--out", str(out)]) == 0
    calibration = Calibration.load(out)
    assert calibration.objective == {"target_sparsity": 0.6, "error": "output"}
    assert calibration.choice == calibration.allocate(target_sparsity=0.6, error="output")
    assert main(base + ["--max-error", "0.2", "--out", str(tmp_path / "bound.json")]) == 2
    assert "error='output' needs target_sparsity" in capsys.readouterr().err


def test_the_command_names_its_mistakes(saved_wan, tmp_path, capsys):
    base = ["calibrate", "--model", str(saved_wan / "transformer"), "--target-sparsity", "0.5"]
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a cat\n")
    assert main(base + ["--prompts", str(prompts)]) == 2
    assert "--prompts needs --height, --width and --frames" in capsys.readouterr().err
    size = ["--height", "32", "--width", "32", "--frames", "5"]
    assert main(base + ["--prompts", "0"] + size) == 2 and main(base + ["--prompts", "99"] + size) == 2
    assert capsys.readouterr().err.count("built-in prompts, or a file") == 2
    assert main(base + ["--data", str(tmp_path / "nowhere")]) == 2
    assert "nowhere" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(base[:-1] + ["1.5", "--data", str(saved_wan / "latents")])
    assert "a mean sparsity in (0, 1)" in capsys.readouterr().err
    for bad in ("0.9,0.5", "0.5", "0,2"):
        with pytest.raises(SystemExit):
            main(base + ["--data", str(saved_wan / "latents"), "--noise-range", bad])
        assert "LOW,HIGH with 0 <= LOW < HIGH <= 1" in capsys.readouterr().err


def test_the_command_measures_one_range_of_noise_levels(saved_wan, tmp_path):
    """An expert of a two-expert pipeline serves a range of noise levels: --noise-range puts the triples there."""
    out = tmp_path / "calibration.json"
    assert main(["calibrate", "--model", str(saved_wan / "transformer"), "--data", str(saved_wan / "latents"),
                 "--target-sparsity", "0.5", "--block-q", "64", "--block-k", "64", "--per-bin", "1", "--bins", "2",
                 "--noise-range", "0.5,0.9", "--device", "cpu", "--out", str(out)]) == 0
    assert Calibration.load(out).inputs["bin_edges"] == pytest.approx([0.5, 0.7, 0.9])


def test_the_command_calibrates_from_prompts_through_the_pipeline(tmp_path):
    pytest.importorskip("av")  # test_cache's module needs it
    from test_cache import tiny_wan_pipeline

    tiny_wan_pipeline().save_pretrained(tmp_path / "pipeline")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red cat runs\n\nblue ball rolls\n")
    # 9 frames of 128 x 128: 3 x 16 x 16 latents, 3 x 8 x 8 = 192 tokens after 2 x 2 patches (3 x 3 tiles of 64).
    assert main(["calibrate", "--model", str(tmp_path / "pipeline"), "--prompts", str(prompts), "--height", "128",
                 "--width", "128", "--frames", "9", "--steps", "2", "--guidance", "1.0", "--block-q", "64",
                 "--block-k", "64", "--target-sparsity", "0.5"]) == 0
    calibration = Calibration.load(tmp_path / "pipeline" / "sparse_calibration.json")
    assert calibration.inputs["prompts"] == ["a red cat runs", "blue ball rolls"]
    assert calibration.inputs["calls_per_layer"] == [4, 4]  # 2 prompts x 2 steps, no guidance pass
    # --prompts N: the first N built-in prompts
    assert main(["calibrate", "--model", str(tmp_path / "pipeline"), "--prompts", "1", "--height", "128",
                 "--width", "128", "--frames", "9", "--steps", "2", "--guidance", "1.0", "--block-q", "64",
                 "--block-k", "64", "--target-sparsity", "0.5", "--out", str(tmp_path / "builtin.json")]) == 0
    calibration = Calibration.load(tmp_path / "builtin.json")
    assert calibration.inputs["prompts"] == [CALIBRATION_PROMPTS[0]] and calibration.inputs["calls_per_layer"] == [2, 2]


def test_the_command_calibrates_both_experts_of_a_two_expert_pipeline(tmp_path, capsys):
    """Wan2.2's A14B pipelines sample the high-noise steps with ``transformer`` and the others with ``transformer_2``:
    each gets its own calibration from the same samplings, and they load onto the pipeline in one call."""
    pytest.importorskip("av")  # test_cache's module needs it
    from test_cache import tiny_wan_pipeline

    pipe = tiny_wan_pipeline()
    torch.manual_seed(1)
    pipe.register_modules(transformer_2=type(pipe.transformer).from_config(pipe.transformer.config))
    pipe.register_to_config(boundary_ratio=0.9)  # steps at t >= 900 run `transformer`, the rest `transformer_2`
    pipe.save_pretrained(tmp_path / "pipeline")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red cat runs\nblue ball rolls\n")
    assert main(["calibrate", "--model", str(tmp_path / "pipeline"), "--prompts", str(prompts), "--height", "128",
                 "--width", "128", "--frames", "9", "--steps", "4", "--guidance", "1.0", "--block-q", "64",
                 "--block-k", "64", "--target-sparsity", "0.5"]) == 0
    printed = capsys.readouterr().out
    assert "transformer:" in printed and "transformer_2:" in printed
    files = {name: tmp_path / "pipeline" / f"sparse_calibration{suffix}.json"
             for name, suffix in (("transformer", ""), ("transformer_2", "_transformer_2"))}
    calibrations = {name: Calibration.load(path) for name, path in files.items()}
    calls = [c.inputs["calls_per_layer"] for c in calibrations.values()]
    assert all(min(c) >= 1 for c in calls) and calls[0][0] + calls[1][0] == 8  # 2 prompts x 4 steps between them
    assert (tmp_path / "pipeline" / "sparse_calibration_transformer_2.png").stat().st_size > 0
    sv.apply_sparse_attention(pipe, {name: sv.SparseConfig.from_calibration(path) for name, path in files.items()})
    assert sv.is_sparse(pipe.transformer) and sv.is_sparse(pipe.transformer_2)


def test_the_table_lists_heads_or_counts_them(calibration):
    from sparsevid.eval.calibrate import calibration_table

    calibration.choose(target_sparsity=0.5)
    labels = calibration.summary()["labels"]
    full, short = calibration_table(calibration).splitlines(), calibration_table(calibration, max_heads=1).splitlines()
    assert len(full) == len(short) == 3 + 2  # header, 3 layers, overall
    assert all(label in full[1] for label in labels[0])
    counts = [int(part.split()[0]) for part in short[1].split("  ")[-1].split(";")[0].split(", ")]
    assert sum(counts) == 2 and "sparsity" in short[1]


def test_a_calibration_file_is_a_config_spec_for_the_commands(calibration, tmp_path):
    from sparsevid.plan import parse_config

    calibration.choose(target_sparsity=0.5)
    path = calibration.save(tmp_path / "sparse_calibration.json")
    assert parse_config(str(path)) == calibration.config()
    plain = tmp_path / "plain.json"
    plain.write_text(sv.SparseConfig(topk=0.2).to_json())
    assert parse_config(str(plain)) == sv.SparseConfig(topk=0.2)


def test_the_config_of_a_choice_per_layer(calibration):
    topk = calibration.candidates.index(Candidate("topk", 0.5))
    topp = calibration.candidates.index(Candidate("topp", 0.9))
    calibration.choice = [[topk, topk], [0, 0], [topk, topp]]
    overrides = calibration.config().layer_overrides
    assert overrides[0] == {"rule": "hybrid", "topk": 0.5, "topp": 1e-6}  # one setting: scalars
    assert overrides[1] == {"dense": True}
    assert overrides[2] == {"rule": "hybrid", "topk": (0.5, 1e-6), "topp": (1e-6, 0.9)}
    with pytest.raises(ValueError, match="come from the calibration"):
        calibration.config(dense_layers=(1,))


@pytest.mark.parametrize("name", list(MODELS))
def test_every_family_calibrates_and_its_saved_calibration_runs(name, tmp_path):
    """Every supported family, joint text-video attention included: each layer is measured (through the sparse
    processors, with every layer dense), the measuring leaves the model as it was, a candidate that keeps every
    tile reproduces the dense output of its heads (the video rows merged with their text keys, where there are
    any), and the saved choice loads and runs sparse."""
    model, inputs = build(name)
    with torch.no_grad():
        dense_out = run_model(model, inputs)
    candidates = (Candidate("dense"), Candidate("topk", 1.0), Candidate("topk", 0.5), Candidate("topp", 0.5))
    calibration = calibrate_heads(model, [lambda: run_model(model, inputs)], candidates=candidates,
                                  backend="reference", **BLOCKS)
    assert not sv.is_sparse(model)
    with torch.no_grad():
        assert torch.equal(run_model(model, inputs), dense_out)
    attentions = adapter_for(model).self_attentions(model)
    assert calibration.model["heads"] == [attention_heads(a) for a in attentions]
    assert min(calibration.inputs["calls_per_layer"]) >= 1
    assert calibration.output_error is not None  # every layer's output projection found (single-stream: proj_out)
    for layer in calibration.error:
        for dense, every_tile, half, mass in layer:
            assert dense == 0.0 and every_tile < 1e-5 < half  # float32 rounding only, then a real loss
    assert all(row[2] > 0 for layer in calibration.sparsity for row in layer)
    calibration.choose(target_sparsity=0.3)
    config = sv.SparseConfig.from_calibration(calibration.save(tmp_path / "calibration.json"), backend="reference")
    sv.apply_sparse_attention(model, config)
    with torch.no_grad():
        sparse_out = run_model(model, inputs)
    assert torch.isfinite(sparse_out).all() and relative_error(sparse_out, dense_out) > 0
