"""Sharded data parallelism with FSDP2 (``torch.distributed.fsdp.fully_shard``): each transformer block and the
root are sharded over the ranks, so a model too large for one device trains on several; and the full (unsharded)
weights and optimiser state that checkpoints and students are written from.

Every function here that reads or writes a sharded model is a collective: all ranks call it.
"""
from __future__ import annotations

import torch

from ..integration import adapter_for


def is_sharded(module: torch.nn.Module) -> bool:
    """Whether ``module``'s parameters are FSDP2 shards (DTensors)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in module.parameters())


def shard(transformer: torch.nn.Module) -> torch.nn.Module:
    """Shard a diffusers video transformer in place: every block of its attention block lists, then the root."""
    from torch.distributed.fsdp import fully_shard

    for blocks_attr, _ in adapter_for(transformer).block_attrs:
        for block in getattr(transformer, blocks_attr):
            fully_shard(block)
    fully_shard(transformer)
    return transformer


def _options(**extra):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **extra)


def full_model_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole ``state_dict`` of a sharded module, on the CPU (on rank 0; other ranks get an empty dict)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(module, options=_options(cpu_offload=True))


def full_optimizer_state(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[int, dict]:
    """The optimiser state of a sharded module's parameters, whole and on the CPU, keyed by the parameter's
    position in ``optimizer.param_groups`` (as checkpoints store it; on rank 0, others get {})."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    state = get_optimizer_state_dict(module, optimizer, options=_options(cpu_offload=True))
    if not state:
        return {}
    position = {name: i for i, name in enumerate(name for group in state["param_groups"] for name in group["params"])}
    return {position[name]: values for name, values in state["state"].items()}


def load_full_states(module: torch.nn.Module, optimizer: torch.optim.Optimizer, model_state: dict[str, torch.Tensor],
                     optimizer_state: dict[int, dict]) -> None:
    """Put whole weights and optimiser state (keyed as :func:`full_optimizer_state` gives it; every rank passes
    the same) onto a sharded module and its optimiser."""
    from torch.distributed.checkpoint.state_dict import (get_optimizer_state_dict, set_model_state_dict,
                                                         set_optimizer_state_dict)

    set_model_state_dict(module, model_state, options=_options())
    current = get_optimizer_state_dict(module, optimizer, options=_options())  # the parameter names, in order
    order = [name for group in current["param_groups"] for name in group["params"]]
    set_optimizer_state_dict(module, optimizer, {"state": {order[i]: values for i, values in optimizer_state.items()},
                                                 "param_groups": current["param_groups"]}, options=_options())
