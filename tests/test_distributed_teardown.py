"""``teardown`` frees the process group before the interpreter shuts down, even after FSDP2 (whose device meshes
outlive the model in DTensor's caches): two gloo processes on the CPU."""
import os
import weakref

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sparsevid.training import setup, teardown
from sparsevid.training.sharding import full_model_state

WORLD = 2


def _train_sharded_model() -> None:
    """A sharded two-layer model: one optimiser step and a gather of its whole weights (collectives of both
    kinds: FSDP2's and DTensor's)."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(3, 8)).square().mean().backward()
    optimizer.step()
    whole = {"0.weight", "0.bias", "2.weight", "2.bias"} if dist.get_rank() == 0 else set()
    assert set(full_model_state(model)) == whole


def _worker(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD))
    job = setup("cpu")
    assert job.world_size == WORLD
    try:
        _train_sharded_model()
        group = weakref.ref(dist.group.WORLD)
    finally:
        teardown()
    with open(f"{out_dir}/rank{rank}.txt", "w") as report:
        report.write("freed" if group() is None else "alive")


def test_teardown_frees_the_process_group_after_fsdp(tmp_path, free_port):
    mp.spawn(_worker, args=(free_port, str(tmp_path)), nprocs=WORLD)
    assert [(tmp_path / f"rank{r}.txt").read_text() for r in range(WORLD)] == ["freed"] * WORLD
