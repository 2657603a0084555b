"""Sparse attention under diffusers' Ulysses context parallelism: two gloo processes running tiny models of the
families it supports match one process; the other families are refused in either order; the heads each rank holds;
refused configurations (float32, CPU)."""
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import sparsevid as sv
from sparsevid.training import teardown
from sparsevid.integration.adapters import ADAPTERS, adapter_for
from sparsevid.integration.context_parallel import JOINT_FAMILIES, PARALLEL_FAMILIES, check_parallel_config, head_range

pytest.importorskip("diffusers")
from diffusers import ContextParallelConfig, ParallelConfig  # noqa: E402
from tiny_models import VIDEO_TOKENS, build, relative_error, run_model  # noqa: E402

WORLD = 2
SPARSE = sv.SparseConfig(rule="topk", topk=0.3, block_q=64, block_k=64)
FULL = sv.SparseConfig(rule="topk", topk=1.0, block_q=64, block_k=64)
# diffusers 0.42.1's own context parallelism of LTX-Video and LTX-2 fails on a text mask (their processors repeat
# it over all heads, the all-to-all leaves each rank H/P), on a per-token timestep (their plans do not split it) and,
# for LTX-2, on the audio-video cross-attentions (the plan leaves their video RoPE whole): inputs it runs on.
LTX_INPUTS = {"timestep": torch.tensor([700.0, 700.0]), "encoder_attention_mask": None}
LTX2_INPUTS = {**LTX_INPUTS, "isolate_modalities": True}


class Scenario(NamedTuple):
    """A tiny ``family`` model (``model_config`` overrides, ``inputs`` replaced) under Ulysses (``options`` for
    ContextParallelConfig) with ``cfg`` applied, parallelism enabled before applying when ``enable_first``."""

    family: str
    cfg: sv.SparseConfig = SPARSE
    enable_first: bool = True
    model_config: dict = {}  # never modified
    options: dict = {}
    inputs: dict = {}


# "wan-tiled": every layer sparse in the forward's 3D-tile order (RoPE tables tiled before diffusers splits them);
# "wan-mixed": layer 0 dense (the original processor, all-to-alls by diffusers), layer 2 tiles its own q, k, v;
# "wan-padded": 3 heads over 2 ranks (ulysses_anything pads them to 4): rank 0 holds heads 0, 1 and rank 1 head 2;
# "wan22-ti2v": Wan2.2 TI2V's per-token timestep [B, N] tiled before diffusers' plan splits it;
# "ltx": tokens [B, N, C] tiled before diffusers' plan splits the transformer's input; "ltx2": per-layer tiling.
SCENARIOS = {
    "wan-tiled": Scenario("wan"),
    "wan-mixed": Scenario("wan", sv.SparseConfig(rule="topk", topk=0.3, block_q=64, block_k=64, dense_layers=(0,),
                                                 layer_overrides={2: {"tile": "none"}}), enable_first=False),
    "wan-padded": Scenario("wan", model_config={"num_attention_heads": 3}, options={"ulysses_anything": True}),
    "wan22-ti2v": Scenario("wan22_ti2v"),
    "chronoedit": Scenario("chronoedit", enable_first=False),
    "ltx": Scenario("ltx", inputs=LTX_INPUTS),
    "ltx2": Scenario("ltx2", enable_first=False, inputs=LTX2_INPUTS),
}
# Every tile kept: the two ranks match the stock model in one process.
FULL_DENSITY = {f"{name}-full": Scenario(name, FULL, inputs=inputs)
                for name, inputs in (("wan", {}), ("chronoedit", {}), ("ltx", LTX_INPUTS), ("ltx2", LTX2_INPUTS))}
HEADS = {"wan-padded": [(0, 2), (2, 3)]}  # (first, last + 1) global heads per rank; others [(0, 1), (1, 2)]
ADAPTER = {adapter.name: adapter for adapter in ADAPTERS}
# Every other family (its tiny model has the adapter's name) is refused under context parallelism, in either order.
REFUSED = [name for name in ADAPTER if name not in PARALLEL_FAMILIES]
# enable_parallelism hands its config to the processors that take one, where a sparse one refuses it; the processors
# of these families take none, so a sparse model of theirs refuses at its first forward.
NO_PARALLEL_PROCESSOR = ("cogvideox", "consisid", "easyanimate", "cosmos", "allegro", "mochi")


def _ulysses(degree=WORLD, **kwargs):
    return ParallelConfig(context_parallel_config=ContextParallelConfig(ulysses_degree=degree, **kwargs))


def _inputs(scenario: Scenario) -> tuple:
    """(model, inputs) of ``scenario``'s tiny model, seeded."""
    model, inputs = build(scenario.family, **scenario.model_config)
    return model, {**inputs, **scenario.inputs}


@torch.no_grad()
def _sparse_forward(model, inputs):
    """(output, per-layer stats) of one forward."""
    return run_model(model, inputs), sv.attention_stats(model)


def _parallel_sparse_run(scenario: Scenario):
    """(output, stats) of ``scenario`` on this rank."""
    model, inputs = _inputs(scenario)
    parallel = _ulysses(**scenario.options)
    if scenario.enable_first:
        model.enable_parallelism(config=parallel)
    sv.apply_sparse_attention(model, scenario.cfg, collect_stats=True)
    if not scenario.enable_first:
        model.enable_parallelism(config=parallel)
    return _sparse_forward(model, inputs)


def _refusal(name: str, enable_first: bool) -> tuple[str, str] | None:
    """(where, message) of the ValueError that refuses tiny model ``name`` sparse under context parallelism
    ("apply", "enable" or "forward"), None if nothing refused it. diffusers has no plan for these families, so
    parallelism is enabled with an empty plan of one's own (``cp_plan={}``): the refusal does not depend on it."""
    model, inputs = build(name)
    stage = "enable" if enable_first else "apply"
    try:
        if enable_first:
            model.enable_parallelism(config=_ulysses(), cp_plan={})
            stage = "apply"
            sv.apply_sparse_attention(model, SPARSE)
        else:
            sv.apply_sparse_attention(model, SPARSE)
            stage = "enable"
            model.enable_parallelism(config=_ulysses(), cp_plan={})
            stage = "forward"
            run_model(model, inputs)
    except ValueError as error:
        return stage, str(error)
    return None


def _worker(rank, rendezvous, out_dir):
    """One rank: each scenario on a fresh tiny model under Ulysses, and each refused family in either order; the
    outputs, stats and refusals saved for the parent."""
    torch.set_num_threads(1)
    torch.accelerator.device_count = lambda: 1  # diffusers picks device rank % count; a CPU host counts 0
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=WORLD)
    try:
        runs = {**SCENARIOS, **FULL_DENSITY}
        results = {
            "runs": {name: _parallel_sparse_run(scenario) for name, scenario in runs.items()},
            "refusals": {(name, first): _refusal(name, first) for name in REFUSED for first in (True, False)},
        }
        torch.save(results, f"{out_dir}/rank{rank}.pt")
    finally:
        teardown()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """What each of the two ranks of one launch saved (see ``_worker``)."""
    out = tmp_path_factory.mktemp("context_parallel")
    mp.spawn(_worker, args=(str(out / "rendezvous"), str(out)), nprocs=WORLD)
    return [torch.load(out / f"rank{rank}.pt") for rank in range(WORLD)]


@pytest.mark.parametrize("name", SCENARIOS)
def test_two_ulysses_ranks_match_one_process(ranks, name):
    scenario = SCENARIOS[name]
    model, inputs = _inputs(scenario)
    dense = run_model(model, inputs)
    sv.apply_sparse_attention(model, scenario.cfg, collect_stats=True)
    ref, ref_stats = _sparse_forward(model, inputs)
    assert relative_error(ref, dense) > 1e-3  # the masks really drop tiles
    heads = HEADS.get(name, [(0, 1), (1, 2)])
    for rank, results in enumerate(ranks):
        out, stats = results["runs"][name]
        # Each rank attends the same tokens with the same per-head masks and only the projections run over
        # half the tokens: the outputs agree up to float32 rounding.
        assert torch.isfinite(out).all() and relative_error(out, ref) < 1e-5
        assert [s["dense"] for s in stats] == [s["dense"] for s in ref_stats]
        assert all(s["heads"] == heads[rank] and s["video_tokens"] == VIDEO_TOKENS[scenario.family]
                   for s in stats if not s["dense"])
    # Each rank's sparsity is the mean over its heads: weighted by their count, the single-process mean.
    for layer, ref_layer in enumerate(ref_stats):
        total = sum(results["runs"][name][1][layer]["sparsity"] * (stop - start)
                    for results, (start, stop) in zip(ranks, heads))
        assert total / heads[-1][1] == pytest.approx(ref_layer["sparsity"], abs=1e-12)


@pytest.mark.parametrize("name", FULL_DENSITY)
def test_two_ulysses_ranks_at_full_density_match_the_stock_model(ranks, name):
    stock = run_model(*_inputs(FULL_DENSITY[name]))
    for results in ranks:
        out, stats = results["runs"][name]
        assert all(s["sparsity"] == 0 for s in stats)
        # The same attention in 3D-tile order and over the ranks' heads: float32 rounding only.
        assert relative_error(out, stock) < 1e-5


@pytest.mark.parametrize("name", REFUSED)
def test_families_without_context_parallel_support_are_refused_in_either_order(ranks, name):
    adapter = ADAPTER[name]
    joint = "joint text-video attention" if adapter.name in JOINT_FAMILIES else "no context-parallel plan"
    late = "forward" if name in NO_PARALLEL_PROCESSOR else "enable"
    for results in ranks:
        for enable_first, stage in ((True, "apply"), (False, late)):
            refusal = results["refusals"][name, enable_first]
            assert refusal is not None and refusal[0] == stage
            assert f"{adapter.class_name} is refused: " in refusal[1] and joint in refusal[1]


@pytest.mark.parametrize("rank, degree, heads, expected", [
    (0, 2, 40, range(0, 20)), (1, 2, 40, range(20, 40)), (3, 4, 40, range(30, 40)),
    (0, 4, 30, range(0, 8)), (3, 4, 30, range(24, 30)),   # ulysses_anything: 30 heads padded to 32
    (0, 1, 12, range(0, 12)),
], ids=["r0of2", "r1of2", "r3of4", "padded-r0", "padded-last", "single"])
def test_head_range_follows_diffusers_head_split(rank, degree, heads, expected):
    assert head_range(rank, degree, heads) == expected


def test_head_range_rejects_a_rank_outside_the_group():
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\)"):
        head_range(2, 2, 40)


@pytest.mark.parametrize("ring, ulysses", [(2, 1), (2, 2)], ids=["ring", "ring+ulysses"])
def test_ring_attention_is_refused(ring, ulysses):
    config = ParallelConfig(context_parallel_config=ContextParallelConfig(ring_degree=ring, ulysses_degree=ulysses))
    with pytest.raises(ValueError, match=f"Ulysses context parallelism only, got ring_degree={ring}"):
        check_parallel_config(config, ADAPTER["wan"])
    # Parallelism first: enable_parallelism records the config on the model (and gives it to the processors).
    model, _ = build("wan")
    attentions = adapter_for(model).self_attentions(model)
    originals = [attn.processor for attn in attentions]
    model._parallel_config = config
    with pytest.raises(ValueError, match="ring_degree"):
        sv.apply_sparse_attention(model)
    assert not sv.is_sparse(model) and all(a.processor is p for a, p in zip(attentions, originals))
    # Sparse attention first: enable_parallelism hands the config to the sparse processors.
    model, _ = build("wan")
    sv.apply_sparse_attention(model)
    with pytest.raises(ValueError, match="ring_degree"):
        adapter_for(model).self_attentions(model)[0].processor._parallel_config = config


def test_heads_must_divide_among_the_ulysses_ranks():
    wan = ADAPTER["wan"]
    with pytest.raises(ValueError, match="6 heads, not divisible by ulysses_degree=4"):
        check_parallel_config(_ulysses(4), wan, heads=6)
    check_parallel_config(_ulysses(4, ulysses_anything=True), wan, heads=6)
    check_parallel_config(_ulysses(2), wan, heads=6)
    check_parallel_config(None, wan, heads=6)


def test_enable_parallelism_reaches_the_original_processors_through_the_sparse_ones():
    model, _ = build("wan")
    attentions = adapter_for(model).self_attentions(model)
    originals = [attn.processor for attn in attentions]
    sv.apply_sparse_attention(model)
    config = _ulysses()
    for attn in attentions:
        assert attn.processor._parallel_config is None
        attn.processor._parallel_config = config  # what enable_parallelism does to every processor that has it
    assert all(attn.processor._native._parallel_config is config for attn in attentions)
    sv.remove_sparse_attention(model)
    assert all(p._parallel_config is config for p in originals)
    # Processors without context-parallel support (CogVideoX) stay without it, so diffusers skips them too.
    model, _ = build("cogvideox")
    sv.apply_sparse_attention(model)
    assert not any(hasattr(attn.processor, "_parallel_config") for attn in adapter_for(model).self_attentions(model))
