"""Sparse attention under diffusers' Ulysses context parallelism: two gloo processes running a tiny Wan match
one process; the heads each rank holds; refused configurations (float32, CPU)."""
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import sparsevid as sv
from sparsevid.integration.adapters import adapter_for
from sparsevid.integration.context_parallel import check_parallel_config, head_range

pytest.importorskip("diffusers")
from diffusers import ContextParallelConfig, ParallelConfig  # noqa: E402
from tiny_models import build, relative_error  # noqa: E402

WORLD = 2
SPARSE = sv.SparseConfig(rule="topk", topk=0.3, block_q=64, block_k=64)
# name: (tiny Wan config, ContextParallelConfig options, SparseConfig, parallelism enabled before applying).
# "tiled": every layer sparse in the forward's 3D-tile order (RoPE tables tiled before diffusers splits them);
# "mixed": layer 0 dense (the original processor, all-to-alls by diffusers), layer 2 tiles its own q, k, v;
# "padded": 3 heads over 2 ranks (ulysses_anything pads them to 4): rank 0 holds heads 0, 1 and rank 1 head 2.
SCENARIOS = {
    "tiled": ({}, {}, SPARSE, True),
    "mixed": ({}, {}, sv.SparseConfig(rule="topk", topk=0.3, block_q=64, block_k=64, dense_layers=(0,),
                                      layer_overrides={2: {"tile": "none"}}), False),
    "padded": ({"num_attention_heads": 3}, {"ulysses_anything": True}, SPARSE, True),
}
HEADS = {"tiled": [(0, 1), (1, 2)], "mixed": [(0, 1), (1, 2)], "padded": [(0, 2), (2, 3)]}


def _ulysses(degree=WORLD, **kwargs):
    return ParallelConfig(context_parallel_config=ContextParallelConfig(ulysses_degree=degree, **kwargs))


@torch.no_grad()
def _sparse_forward(model, inputs):
    """(output, per-layer stats) of one forward."""
    out = model(**inputs, return_dict=False)[0]
    return out, sv.attention_stats(model)


def _worker(rank, rendezvous, out_dir):
    """One rank: each scenario on a fresh tiny Wan under Ulysses; outputs and stats saved for the parent."""
    torch.set_num_threads(1)
    torch.accelerator.device_count = lambda: 1  # diffusers picks device rank % count; a CPU host counts 0
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=WORLD)
    try:
        results = {}
        for name, (model_config, options, cfg, enable_first) in SCENARIOS.items():
            model, inputs = build("wan", **model_config)
            parallel = _ulysses(**options)
            if enable_first:
                model.enable_parallelism(config=parallel)
            sv.apply_sparse_attention(model, cfg, collect_stats=True)
            if not enable_first:
                model.enable_parallelism(config=parallel)
            results[name] = _sparse_forward(model, inputs)
        torch.save(results, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.barrier()
        dist.destroy_process_group()


def test_two_ulysses_ranks_match_one_process(tmp_path):
    mp.spawn(_worker, args=(str(tmp_path / "rendezvous"), str(tmp_path)), nprocs=WORLD)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    for name, (model_config, _, cfg, _) in SCENARIOS.items():
        model, inputs = build("wan", **model_config)
        with torch.no_grad():
            dense = model(**inputs, return_dict=False)[0]
        sv.apply_sparse_attention(model, cfg, collect_stats=True)
        ref, ref_stats = _sparse_forward(model, inputs)
        assert relative_error(ref, dense) > 1e-3  # the masks really drop tiles
        for rank, results in enumerate(ranks):
            out, stats = results[name]
            # Each rank attends the same tokens with the same per-head masks and only the projections run over
            # half the tokens: the outputs agree up to float32 rounding.
            assert torch.isfinite(out).all() and relative_error(out, ref) < 1e-5, name
            sparse = [s for s in stats if not s["dense"]]
            assert [s["dense"] for s in stats] == [s["dense"] for s in ref_stats]
            assert all(s["heads"] == HEADS[name][rank] and s["video_tokens"] == 320 for s in sparse)
        # Each rank's sparsity is the mean over its heads: weighted by their count, the single-process mean.
        for layer, ref_layer in enumerate(ref_stats):
            total = sum(results[name][1][layer]["sparsity"] * (stop - start)
                        for results, (start, stop) in zip(ranks, HEADS[name]))
            assert total / HEADS[name][-1][1] == pytest.approx(ref_layer["sparsity"], abs=1e-12)


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
        check_parallel_config(config)
    model, _ = build("wan")
    attentions = adapter_for(model).self_attentions(model)
    originals = [attn.processor for attn in attentions]
    for processor in originals:
        processor._parallel_config = config
    with pytest.raises(ValueError, match="ring_degree"):
        sv.apply_sparse_attention(model)
    assert not sv.is_sparse(model) and all(a.processor is p for a, p in zip(attentions, originals))


def test_heads_must_divide_among_the_ulysses_ranks():
    with pytest.raises(ValueError, match="6 heads, not divisible by ulysses_degree=4"):
        check_parallel_config(_ulysses(4), heads=6)
    check_parallel_config(_ulysses(4, ulysses_anything=True), heads=6)
    check_parallel_config(_ulysses(2), heads=6)
    check_parallel_config(None, heads=6)


def test_joint_text_video_attention_is_refused_under_context_parallelism():
    model, inputs = build("hunyuan_video")
    sv.apply_sparse_attention(model)
    for attn in adapter_for(model).self_attentions(model):
        attn.processor._parallel_config = _ulysses()
    with pytest.raises(ValueError, match="video-only self-attention"):
        model(**inputs)


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
