"""Per-head budgets under diffusers' Ulysses context parallelism: two gloo processes, each holding the whole
sequence of some heads, predict those heads' masks with their own slice of the budgets and match one process
(tiny Wan, float32, CPU)."""
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import sparsevid as sv
from sparsevid.training import teardown

pytest.importorskip("diffusers")
from diffusers import ContextParallelConfig, ParallelConfig  # noqa: E402
from tiny_models import build  # noqa: E402

WORLD = 2
# 4 heads, 2 per rank; each head of layers 0 and 2 its own budget (layer 1 dense), so that a rank using
# another rank's budgets, or the first heads' budgets, would give other masks.
CONFIG = sv.SparseConfig(rule="hybrid", block_q=64, block_k=64, layer_overrides={
    0: {"topk": [0.2, 0.8, 0.4, 1e-6], "topp": [1e-6, 1e-6, 1e-6, 0.6]},
    1: {"dense": True},
    2: {"topk": [1.0, 0.2, 0.6, 0.2], "topp": [1.0, 1e-6, 1e-6, 1e-6]}})


def _model():
    torch.manual_seed(0)
    return build("wan", num_attention_heads=4)


def _predict_under_ulysses(rank, out_dir):
    """The tiny model's output and stats on this rank of the Ulysses group, saved for the parent."""
    model, inputs = _model()
    model.enable_parallelism(config=ParallelConfig(context_parallel_config=ContextParallelConfig(
        ulysses_degree=WORLD)))
    sv.apply_sparse_attention(model, CONFIG, collect_stats=True)
    with torch.no_grad():
        out = model(**inputs, return_dict=False)[0]
    torch.save((out, sv.attention_stats(model)), f"{out_dir}/rank{rank}.pt")


def _worker(rank, rendezvous, out_dir):
    torch.set_num_threads(1)
    torch.accelerator.device_count = lambda: 1  # diffusers picks device rank % count; a CPU host counts 0
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=WORLD)
    try:
        _predict_under_ulysses(rank, out_dir)  # the model is gone with its frame: teardown frees the group
    finally:
        teardown()


def test_each_rank_predicts_its_heads_with_their_own_budgets(tmp_path):
    mp.spawn(_worker, args=(str(tmp_path / "rendezvous"), str(tmp_path)), nprocs=WORLD)
    model, inputs = _model()
    sv.apply_sparse_attention(model, CONFIG, collect_stats=True)
    with torch.no_grad():
        reference = model(**inputs, return_dict=False)[0]
    stats = sv.attention_stats(model)
    # Layer 0: heads 0, 1 keep 1 and 4 of the 5 key blocks (80% and 20% sparse) and rank 0 reports their mean; rank 1
    # holds heads 2 and 3 (a top-p head: the scores decide).
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    assert ranks[0][1][0]["sparsity"] == pytest.approx(0.5, abs=1e-12)
    for rank, (out, rank_stats) in enumerate(ranks):
        # The same tokens, masks and kernels; only the projections run over half the tokens: float32 rounding.
        assert float((out - reference).norm() / reference.norm()) < 1e-5
        assert [s["heads"] for s in rank_stats if not s["dense"]] == [(2 * rank, 2 * rank + 2)] * 2
    for layer in (0, 2):  # each rank's mean over its 2 heads: together the single-process mean over 4
        mean = sum(rank_stats[layer]["sparsity"] for _, rank_stats in ranks) / WORLD
        assert mean == pytest.approx(stats[layer]["sparsity"], abs=1e-12)
