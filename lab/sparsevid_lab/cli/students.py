"""Sparse students as the commands take them (``--student DIR``): a student folder (``sparsevid distill`` or
``python -m sparsevid_lab distill`` output, or a shipped one) over the dense weights of the command's model."""
from __future__ import annotations

import copy
from pathlib import Path

from sparsevid.training import STUDENT_CONFIG, STUDENT_WEIGHTS

from ..model.sparse_student import STUDENT_DIR, load_sparse_student


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


def read_student_like(directory: str | Path, reference, base: str | Path | None = None):
    """(model, SparseConfig) of the student in ``directory`` over ``base``, dense (sparse attention not applied),
    on the device and in the dtype of ``reference`` (a dense BuiltinVideoDiT), making clips of its shape with its
    sampler settings (e.g. the CPU defaults' steps), so that its clips compare with the reference's. ValueError
    if they cannot."""
    parameter = next(reference.parameters())
    model, config = load_sparse_student(directory, parameter.device, parameter.dtype, base=base, apply=False)
    model.use_clip(*reference.clip_shape[1:])
    model.config["sampling"] = copy.deepcopy(reference.config["sampling"])
    return model, config
