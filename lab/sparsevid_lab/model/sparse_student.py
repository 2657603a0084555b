"""The built-in model's sparse students: a student folder (sparsevid's student format,
:mod:`sparsevid.training.student`: the fine-tuned self-attention tensors and their SparseConfig) over the dense
built-in weights it was fine-tuned from.

The shipped students live beside the shipped weights: ``sparsevid_lab/assets/sparse_student/`` (75% sparsity, the
demo's) and ``sparse_student_95/``.
"""
from __future__ import annotations

from pathlib import Path

import torch

from sparsevid import SparseConfig, load_student

from .builtin import ASSETS, BuiltinVideoDiT, load_builtin

STUDENT_DIR = "sparse_student"


def load_sparse_student(directory: str | Path | None = None, device: torch.device | str = "cpu",
                        dtype: torch.dtype = torch.float32, base: str | Path | None = None,
                        apply: bool = True) -> tuple[BuiltinVideoDiT, SparseConfig]:
    """(model, SparseConfig): the dense built-in model from ``base`` (default: the folder that holds
    ``directory``) with the student in ``directory`` (default: the shipped ``sparse_student``) loaded over it, in
    eval mode on ``device`` in ``dtype``, its sparse attention switched on (unless ``apply`` is False).
    FileNotFoundError for a missing folder, ValueError when the base is not the student's."""
    directory = Path(directory) if directory is not None else ASSETS / STUDENT_DIR
    model = load_builtin(Path(base) if base is not None else directory.parent, device=device, dtype=dtype)
    return model, load_student(model.transformer, directory, apply=apply)
