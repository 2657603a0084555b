"""Data-parallel helpers over ``torch.distributed``: one process per device, started by ``torchrun``.

Outside a process group (a plain ``python`` run) every helper acts as for a single process of rank 0.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Distributed:
    """This process's place in the job: ``rank`` of ``world_size`` processes, on ``device``."""

    rank: int
    world_size: int
    device: torch.device


def setup(device: str | torch.device) -> Distributed:
    """Join the process group that ``torchrun`` describes in the environment (WORLD_SIZE > 1), with NCCL
    on CUDA (device ``cuda:LOCAL_RANK``) and gloo on the CPU; without it, a single process on ``device``."""
    device = torch.device(device)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        return Distributed(0, 1, device)
    import torch.distributed as dist

    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return Distributed(dist.get_rank(), dist.get_world_size(), device)


def teardown() -> None:
    """Leave the process group, if any, once every rank is done with it (a rank that leaves while another still
    has gloo work in flight can abort the job at exit), and free it now, ending its communication threads.

    Call it once the model is dropped: a DDP or FSDP module holds the group, and a group that outlives this call
    is freed while the interpreter shuts down, where a gloo thread still releasing a finished collective's
    tensors needs the GIL and aborts the process (or hangs it)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
        _release_mesh_groups()


def _release_mesh_groups() -> None:
    """Empty the process-group registries of the live ``DeviceMesh`` objects (FSDP2's meshes outlive the model in
    DTensor's caches, and their registries keep destroyed groups alive), then collect the groups."""
    import gc

    from torch.distributed.device_mesh import DeviceMesh

    for obj in gc.get_objects():
        if isinstance(obj, DeviceMesh):
            getattr(obj, "_pg_registry", {}).clear()
    gc.collect()


def _active() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def is_main_process() -> bool:
    """Rank 0, or not distributed."""
    return not _active() or torch.distributed.get_rank() == 0


def barrier() -> None:
    if _active():
        torch.distributed.barrier()


def global_mean(value: torch.Tensor) -> torch.Tensor:
    """The mean of a scalar tensor over all ranks (the value itself when not distributed)."""
    if not _active():
        return value
    value = value.detach().float().clone()
    torch.distributed.all_reduce(value)
    return value / torch.distributed.get_world_size()


def broadcast_float(value: float, device: torch.device) -> float:
    """Rank 0's ``value`` on every rank (``value`` itself when not distributed); ``device`` is where the
    process group's backend communicates (CUDA for NCCL, CPU for gloo)."""
    if not _active():
        return value
    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    torch.distributed.broadcast(tensor, 0)
    return float(tensor)


def wrap(model: torch.nn.Module, dist_info: Distributed) -> torch.nn.Module:
    """``model`` in ``DistributedDataParallel`` when the job has several processes, else unchanged."""
    if dist_info.world_size == 1:
        return model
    from torch.nn.parallel import DistributedDataParallel

    ids = [dist_info.device.index] if dist_info.device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=ids)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module inside a ``DistributedDataParallel`` wrapper (``model`` itself otherwise)."""
    from torch.nn.parallel import DistributedDataParallel

    return model.module if isinstance(model, DistributedDataParallel) else model
