"""A sparse student shipped as a small asset beside the dense weights it was fine-tuned from.

A student fine-tuned with ``--trainable attention`` differs from its dense base only in the video
self-attention modules (the q, k, v, out projections and their norms: about a fifth of the built-in model).
The asset folder holds just those tensors and the sparse attention they were trained for:

* ``student.safetensors``: the fine-tuned tensors (bf16 by default), named as in the model's ``state_dict``;
* ``student.json``: ``{"sparse_config": SparseConfig dict, "trainable": ..., "base_sha256": ..., ...}``, where
  ``base_sha256`` is the SHA-256 of the dense ``builtin.safetensors`` the student was fine-tuned from (a
  student is meaningless on other base weights, so loading checks it).

:func:`load_sparse_student` rebuilds the student in one call: the dense base model, the student's tensors
loaded over it, and sparse attention applied with its configuration. The default asset is
``sparsevid/assets/sparse_student/`` beside the shipped dense weights. Writing one:
:func:`sparsevid.training.student_asset.export_sparse_student`.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from .builtin import ASSETS, WEIGHTS_FILE, check_model_dtype

STUDENT_DIR = "sparse_student"
STUDENT_WEIGHTS, STUDENT_CONFIG = "student.safetensors", "student.json"
TRAINABLE = ("all", "attention")  # what fine-tuning may change (``sparsevid distill --trainable``)


def file_sha256(path: str | Path) -> str:
    """Hex SHA-256 of the file at ``path``."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def trained_tensor_names(model, trainable: str) -> list[str]:
    """The ``state_dict`` names of ``model``'s tensors that fine-tuning with ``trainable`` changes: every one
    ("all") or those of the transformer's video self-attention modules ("attention")."""
    from sparsevid.integration.adapters import adapter_for

    if trainable not in TRAINABLE:
        raise ValueError(f"trainable must be one of {TRAINABLE}, got {trainable!r}")
    names = list(model.state_dict())
    if trainable == "all":
        return names
    modules = {id(m) for m in adapter_for(model.transformer).self_attentions(model.transformer)}
    prefixes = tuple(f"transformer.{name}." for name, m in model.transformer.named_modules() if id(m) in modules)
    return [name for name in names if name.startswith(prefixes)]


def read_sparse_student(directory: str | Path | None = None, device: torch.device | str = "cpu",
                        dtype: torch.dtype = torch.float32, base: str | Path | None = None):
    """(model, SparseConfig): the dense built-in model from ``base`` (default: the folder that holds
    ``directory``) with the student's tensors from ``directory`` (default: ``sparsevid/assets/sparse_student``)
    loaded over it, in eval mode on ``device`` in ``dtype``, and the sparse attention it was trained for (not
    applied). Raises FileNotFoundError for a missing asset and ValueError when the base weights are not those
    the student was fine-tuned from."""
    from safetensors.torch import load_file

    from sparsevid.plan import SparseConfig
    from .builtin import load_builtin

    check_model_dtype(dtype)
    directory = Path(directory) if directory is not None else ASSETS / STUDENT_DIR
    base = Path(base) if base is not None else directory.parent
    for path in (directory / STUDENT_WEIGHTS, directory / STUDENT_CONFIG, base / WEIGHTS_FILE):
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found (export a student with `python -m sparsevid export-student`)")
    record = json.loads((directory / STUDENT_CONFIG).read_text())
    found = file_sha256(base / WEIGHTS_FILE)
    if found != record["base_sha256"]:
        raise ValueError(f"{base / WEIGHTS_FILE} is not the base this student was fine-tuned from (SHA-256 "
                         f"{found[:12]}..., the student needs {record['base_sha256'][:12]}...)")
    model = load_builtin(base, device=device, dtype=dtype)
    tensors = load_file(str(directory / STUDENT_WEIGHTS))
    expected = model.state_dict()
    wrong = [name for name, t in tensors.items() if name not in expected or expected[name].shape != t.shape]
    if wrong:
        raise ValueError(f"{directory / STUDENT_WEIGHTS} holds tensors the base model lacks or shapes it differs "
                         f"in: {wrong[:3]}")
    model.load_state_dict(tensors, strict=False)  # cast into the model's dtype on the way
    return model, SparseConfig.from_dict(record["sparse_config"])


def load_sparse_student(directory: str | Path | None = None, device: torch.device | str = "cpu",
                        dtype: torch.dtype = torch.float32, base: str | Path | None = None):
    """The shipped sparse student in one call: :func:`read_sparse_student` with sparse attention applied in
    its SparseConfig."""
    from sparsevid.integration.switch import apply_sparse_attention

    model, config = read_sparse_student(directory, device, dtype, base)
    apply_sparse_attention(model.transformer, config)
    return model
