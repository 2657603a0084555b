"""Checkpoints written atomically (temporary file + rename) in safetensors format."""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch


def save_safetensors_atomic(tensors: dict[str, torch.Tensor], path: str | Path,
                            metadata: dict[str, str] | None = None) -> Path:
    """Write ``tensors`` to ``path`` so that readers see either the old file or the complete new one."""
    from safetensors.torch import save_file

    path, tmp = _temporary_beside(path)
    try:
        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(tmp), metadata=metadata)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def write_text_atomic(text: str, path: str | Path) -> Path:
    """Write ``text`` to ``path`` through a temporary file and a rename."""
    path, tmp = _temporary_beside(path)
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _temporary_beside(path: str | Path) -> tuple[Path, Path]:
    """(path, a temporary file name in its folder), the folder created; the rename onto path is atomic."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return path, path.with_name(f".{path.name}.{os.getpid()}.tmp")


def training_tensors(model: torch.nn.Module, ema: dict[str, torch.Tensor],
                     optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The tensors of a training state: model weights, EMA weights, the optimizer state (by parameter position)
    and the global torch RNG states (CPU and the current CUDA device). For an FSDP-sharded model the weights and
    optimizer state are gathered whole (a collective: every rank calls it; rank 0 gets them)."""
    from .sharding import full_model_state, full_optimizer_state, is_sharded

    if is_sharded(model):
        model_state, optimizer_state = full_model_state(model), full_optimizer_state(model, optimizer)
    else:
        position = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
        model_state = model.state_dict()
        optimizer_state = {position[id(p)]: state for p, state in optimizer.state.items()}
    tensors = {f"model.{k}": v for k, v in model_state.items()}
    tensors["rng.cpu"] = torch.get_rng_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        tensors["rng.cuda"] = torch.cuda.get_rng_state()
    tensors.update({f"ema.{k}": v for k, v in ema.items()})
    for index, state in optimizer_state.items():
        for key, value in state.items():
            tensors[f"optim.{index}.{key}"] = torch.as_tensor(value)
    return tensors


def write_training_state(path: str | Path, tensors: dict[str, torch.Tensor], step: int,
                         info: dict | None = None) -> Path:
    """One file holding :func:`training_tensors`, the step count and ``info`` (JSON-serialisable)."""
    metadata = {"step": str(step), "info": json.dumps(info or {})}
    return save_safetensors_atomic(tensors, path, metadata)


def save_training_state(path: str | Path, model: torch.nn.Module, ema: dict[str, torch.Tensor],
                        optimizer: torch.optim.Optimizer, step: int, info: dict | None = None) -> Path:
    """Write the training state of a model in one process (:func:`training_tensors`, :func:`write_training_state`)."""
    return write_training_state(path, training_tensors(model, ema, optimizer), step, info)


def load_training_state(path: str | Path, model: torch.nn.Module, ema: dict[str, torch.Tensor],
                        optimizer: torch.optim.Optimizer) -> tuple[int, dict]:
    """Restore what :func:`save_training_state` wrote, in place (RNG states included; an FSDP-sharded model takes
    the whole weights and optimizer state, every rank reading the file). Returns (step, info)."""
    from safetensors import safe_open

    from .sharding import is_sharded, load_full_states

    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata() or {}
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    model_state = {k[6:]: v for k, v in tensors.items() if k.startswith("model.")}
    if "rng.cpu" in tensors:
        torch.set_rng_state(tensors["rng.cpu"])
    if "rng.cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["rng.cuda"])
    for name, value in ema.items():
        value.copy_(tensors[f"ema.{name}"])
    if is_sharded(model):
        optimizer_state: dict[int, dict] = {}
        for key, value in tensors.items():
            if key.startswith("optim."):
                _, index, field = key.split(".", 2)
                optimizer_state.setdefault(int(index), {})[field] = value
        load_full_states(model, optimizer, model_state, optimizer_state)
        return int(metadata.get("step", 0)), json.loads(metadata.get("info", "{}"))
    model.load_state_dict(model_state)
    groups = [(p, g) for g in optimizer.param_groups for p in g["params"]]
    for key, value in tensors.items():
        if key.startswith("optim."):
            _, index, field = key.split(".", 2)
            p, group = groups[int(index)]
            # Fused and capturable optimisers keep their step counts beside the parameters, the others on the host.
            on_device = field != "step" or group.get("fused") or group.get("capturable")
            optimizer.state[p][field] = value.to(p.device) if on_device else value
    return int(metadata.get("step", 0)), json.loads(metadata.get("info", "{}"))
