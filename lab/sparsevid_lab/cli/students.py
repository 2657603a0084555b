"""Sparse students as the commands take them (``--student DIR``): a shipped asset (``student.json`` and
``student.safetensors``, :mod:`sparsevid.models.sparse_student`) or a ``sparsevid distill`` output directory
(a whole model with its ``sparse_config.json``)."""
from __future__ import annotations

import copy
from pathlib import Path

import torch

from ..model.sparse_student import STUDENT_CONFIG, STUDENT_DIR, STUDENT_WEIGHTS


def is_student_asset(directory: str | Path) -> bool:
    """Whether ``directory`` holds a student asset (``student.json`` and ``student.safetensors``)."""
    return all((Path(directory) / name).is_file() for name in (STUDENT_CONFIG, STUDENT_WEIGHTS))


def student_base(args) -> Path | None:
    """The dense weights a student asset given to a command must have been fine-tuned from: those of the
    command's model (``--model``, else the shipped model); None for ``--tiny`` (the asset's own folder)."""
    from ..model.builtin import ASSETS

    return None if args.tiny else Path(args.model) if args.model else ASSETS


def shipped_student(args) -> Path | None:
    """The student asset shipped beside the command's dense weights (:func:`student_base`, in its
    ``sparse_student`` folder), or None if there is none (always for ``--tiny``)."""
    base = student_base(args)
    return None if base is None or not is_student_asset(base / STUDENT_DIR) else base / STUDENT_DIR


def read_student(directory: str | Path, device: torch.device | str, dtype: torch.dtype,
                 base: str | Path | None = None):
    """(model, SparseConfig) of the student in ``directory``, the model dense (sparse attention not applied),
    in eval mode on ``device`` in ``dtype``. An asset's dense base is ``base`` (default: the folder holding
    it); a distill output is a whole model and needs none."""
    from ..model.sparse_student import read_sparse_student
    from sparsevid.training.distill import load_student

    if is_student_asset(directory):
        return read_sparse_student(directory, device=device, dtype=dtype, base=base)
    return load_student(directory, device=device, dtype=dtype)


def read_student_like(directory: str | Path, reference, base: str | Path | None = None):
    """:func:`read_student` on the device and in the dtype of ``reference`` (a dense BuiltinVideoDiT), making
    clips of its shape with its sampler settings (e.g. the CPU defaults' steps), so that its clips compare with
    the reference's. ValueError if they cannot."""
    parameter = next(reference.parameters())
    model, config = read_student(directory, parameter.device, parameter.dtype, base=base)
    model.use_clip(*reference.clip_shape[1:])
    model.config["sampling"] = copy.deepcopy(reference.config["sampling"])
    return model, config
