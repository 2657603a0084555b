"""A sparse student on disk: the tensors fine-tuning changed and the sparse attention they were trained for.

A folder written by :func:`save_student` holds

* ``student.safetensors``: the fine-tuned tensors, named as in the transformer's ``state_dict`` (for
  ``trainable="attention"`` only the video self-attention modules: about a fifth of a Wan transformer; for
  ``trainable="lora"`` the low-rank adapters of their projections, :mod:`.lora`, merged into the base on loading);
* ``student.json``: ``{"sparse_config": SparseConfig dict, "trainable": ..., "transformer": class name,
  "base_fingerprint": ..., ...}``. The fingerprint is the SHA-256 of the base model's values of the fine-tuned
  tensors: a student only makes sense over the weights it was fine-tuned from, so loading checks it.

:func:`load_student` puts a student onto a transformer (or a pipeline's) in one call.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from ..integration import adapter_for, apply_sparse_attention
from ..plan import SparseConfig
from .checkpoint import save_safetensors_atomic, write_text_atomic
from .lora import ADAPTER_NAME, lora_targets, lora_tensors, merge_lora

TRAINABLE = ("attention", "all", "lora")  # what fine-tuning may change
STUDENT_WEIGHTS, STUDENT_CONFIG = "student.safetensors", "student.json"
# A base is fingerprinted in bf16, so that it is recognised in whatever precision it is loaded (bf16 weights
# loaded as fp32 round back exactly).
FINGERPRINT_DTYPE = torch.bfloat16


def trainable_names(transformer: torch.nn.Module, trainable: str) -> list[str]:
    """The ``named_parameters`` names that fine-tuning with ``trainable`` changes: every parameter ("all"), those of
    the transformer's video self-attention modules ("attention") or of the LoRA adapter added to them ("lora")."""
    if trainable not in TRAINABLE:
        raise ValueError(f"trainable must be one of {TRAINABLE}, got {trainable!r}")
    names = [name for name, _ in transformer.named_parameters()]
    if trainable == "all":
        return names
    if trainable == "lora":
        found = [name for name in names if f".{ADAPTER_NAME}." in name and ".lora_" in name]
        if not found:
            raise ValueError("the transformer has no sparsevid LoRA adapter (add one with sparsevid.training.add_lora)")
        return found
    modules = {id(m) for m in adapter_for(transformer).self_attentions(transformer)}
    prefixes = tuple(f"{name}." for name, m in transformer.named_modules() if id(m) in modules)
    return [name for name in names if name.startswith(prefixes)]


def fingerprint(tensors: dict[str, torch.Tensor]) -> str:
    """Hex SHA-256 over the names, dtypes, shapes and values of ``tensors`` (in name order)."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name].detach().to("cpu").contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


def base_names(transformer: torch.nn.Module, trainable: str) -> list[str]:
    """The ``state_dict`` names of the base tensors a student with ``trainable`` changes (for "lora": the weights of
    the projections its adapters add to), on the transformer before fine-tuning."""
    if trainable == "lora":
        return [f"{target}.weight" for target in lora_targets(transformer)]
    return trainable_names(transformer, trainable)


def base_fingerprint(transformer: torch.nn.Module, trainable: str) -> str:
    """The fingerprint of ``transformer``'s current values of the tensors a student with ``trainable`` changes
    (taken before fine-tuning, it identifies the base a student belongs to)."""
    state = transformer.state_dict()
    return fingerprint({name: state[name].to(FINGERPRINT_DTYPE) for name in base_names(transformer, trainable)})


def save_student(transformer: torch.nn.Module, directory: str | Path, sparse: SparseConfig, trainable: str,
                 base: str, dtype: torch.dtype = torch.bfloat16, extra: dict | None = None,
                 lora: dict | None = None, state: dict[str, torch.Tensor] | None = None) -> Path:
    """Write the fine-tuned part of ``transformer`` (``trainable``) in ``dtype`` and its ``sparse`` setting into
    ``directory``. ``base``: :func:`base_fingerprint` of the weights it was fine-tuned from (taken before).
    ``lora``: for ``trainable="lora"``, {"rank", "alpha", "targets"} of the adapter. ``extra``: JSON-able facts
    recorded in ``student.json`` (the training run). ``state``: the transformer's whole ``state_dict`` when it is
    not the module's own (a sharded model's, gathered). Returns ``directory``."""
    if not isinstance(sparse, SparseConfig):
        raise TypeError(f"sparse must be a sparsevid.SparseConfig, got {type(sparse).__name__}")
    if (trainable == "lora") != (lora is not None):
        raise ValueError("lora (the adapter's rank, alpha and targets) goes with trainable='lora' and only with it")
    directory = Path(directory)
    state = transformer.state_dict() if state is None else state
    if lora is not None:
        tensors = lora_tensors(state, lora["targets"])
    else:
        tensors = {name: state[name] for name in trainable_names(transformer, trainable)}
    save_safetensors_atomic({name: t.detach().to("cpu", dtype) for name, t in tensors.items()},
                            directory / STUDENT_WEIGHTS)
    record = {"sparse_config": sparse.to_dict(), "trainable": trainable, "transformer": type(transformer).__name__,
              "dtype": str(dtype).replace("torch.", ""), "tensors": len(tensors),
              "parameters": sum(t.numel() for t in tensors.values()), "base_fingerprint": base,
              **({} if lora is None else {"lora": lora}), **(extra or {})}
    write_text_atomic(json.dumps(record, indent=2), directory / STUDENT_CONFIG)
    return directory


def read_student(directory: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(``student.json`` as a dict, the fine-tuned tensors) of a student folder."""
    from safetensors.torch import load_file

    directory = Path(directory)
    for path in (directory / STUDENT_WEIGHTS, directory / STUDENT_CONFIG):
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: {directory} is not a student folder (save_student writes "
                                    f"{STUDENT_WEIGHTS} and {STUDENT_CONFIG})")
    return json.loads((directory / STUDENT_CONFIG).read_text()), load_file(str(directory / STUDENT_WEIGHTS))


def load_student(model, directory: str | Path, apply: bool = True):
    """Put the student in ``directory`` onto ``model``, a dense diffusers transformer or a pipeline with one
    (``pipe.transformer``): check that its weights are the student's base, load the fine-tuned tensors (cast to
    the model's dtype) and, with ``apply``, switch on the sparse attention they were trained for. Returns the
    student's SparseConfig.

    Raises ValueError when the model is another class, lacks a tensor or differs from the base."""
    transformer = getattr(model, "transformer", model)
    record, tensors = read_student(directory)
    expected_class = record.get("transformer")
    if expected_class is not None and expected_class != type(transformer).__name__:
        raise ValueError(f"the student in {directory} was fine-tuned from a {expected_class}, not a "
                         f"{type(transformer).__name__}")
    lora = record.get("lora")
    state = transformer.state_dict()
    replaced = [f"{t}.weight" for t in lora["targets"]] if lora is not None else list(tensors)
    missing = [name for name in replaced if name not in state]
    wrong = missing or [name for name, t in tensors.items() if lora is None and state[name].shape != t.shape]
    if wrong:
        raise ValueError(f"{directory}: the transformer lacks the student's tensors or differs in shape: {wrong[:3]}")
    found = fingerprint({name: state[name].to(FINGERPRINT_DTYPE) for name in replaced})
    if found != record["base_fingerprint"]:
        raise ValueError(f"the transformer's weights are not the base the student in {directory} was fine-tuned "
                         f"from (fingerprint {found[:12]}..., the student needs {record['base_fingerprint'][:12]}...)")
    if lora is not None:
        merge_lora(transformer, tensors, lora["rank"], lora["alpha"])
    else:
        transformer.load_state_dict(tensors, strict=False)  # cast into the transformer's dtype on the way
    sparse = SparseConfig.from_dict(record["sparse_config"])
    if apply:
        apply_sparse_attention(transformer, sparse)
    return sparse
