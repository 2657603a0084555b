"""Sparse students as the commands take them (``--student DIR``): a student folder (written by ``distill``, or a
shipped one) over the dense weights of the command's model."""
from __future__ import annotations

import copy
from pathlib import Path

from sparsevid import load_student
from sparsevid.training import STUDENT_CONFIG, STUDENT_WEIGHTS

from ..model.sparse_student import STUDENT_DIR


def is_student(directory: str | Path) -> bool:
    """Whether ``directory`` holds a student (``student.json`` and ``student.safetensors``)."""
    return all((Path(directory) / name).is_file() for name in (STUDENT_CONFIG, STUDENT_WEIGHTS))


def student_base(args) -> Path | None:
    """The dense weights a student given to a command must have been fine-tuned from: those of the command's
    model (``--model``, else the shipped model); None for ``--tiny`` (the student folder's parent)."""
    from ..model.builtin import ASSETS

    return None if args.tiny else Path(args.model) if args.model else ASSETS


def shipped_student(args) -> Path | None:
    """The student shipped beside the command's dense weights (:func:`student_base`, in its ``sparse_student``
    folder), or None if there is none (always for ``--tiny``)."""
    base = student_base(args)
    return None if base is None or not is_student(base / STUDENT_DIR) else base / STUDENT_DIR


def read_student_like(directory: str | Path, reference):
    """(model, SparseConfig): a copy of ``reference`` (a dense BuiltinVideoDiT: its device, dtype, clip shape and
    sampler settings) with the student in ``directory`` loaded over it, dense (sparse attention not applied), so
    that its clips compare with the reference's. ValueError when the reference's weights are not the student's
    base."""
    model = copy.deepcopy(reference)
    return model, load_student(model.transformer, directory, apply=False)
