"""Writing a sparse student as a small asset (:mod:`sparsevid.models.sparse_student`): its fine-tuned
tensors and SparseConfig, from a model or from a ``sparsevid distill`` output folder."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from .builtin import WEIGHTS_FILE
from .sparse_student import STUDENT_CONFIG, STUDENT_WEIGHTS, file_sha256, trained_tensor_names
from sparsevid.training.checkpoint import save_safetensors_atomic, write_text_atomic


def save_sparse_student(student, sparse, trainable: str, base: str | Path, directory: str | Path,
                        dtype: torch.dtype = torch.bfloat16, extra: dict | None = None) -> Path:
    """Write the fine-tuned part of ``student`` (a BuiltinVideoDiT, dense or sparse) and its ``sparse``
    SparseConfig into ``directory`` (see the module docstring). ``base``: the directory of the dense weights
    it was fine-tuned from; every tensor outside the ``trainable`` part must equal the base's (else ValueError:
    the student does not come from this base). ``extra``: JSON-able facts recorded in ``student.json``.
    Returns ``directory``."""
    from safetensors.torch import load_file

    from sparsevid.plan import SparseConfig

    if not isinstance(sparse, SparseConfig):
        raise TypeError(f"sparse must be a sparsevid.SparseConfig, got {type(sparse).__name__}")
    base_weights = Path(base) / WEIGHTS_FILE
    if not base_weights.is_file():
        raise FileNotFoundError(f"{base_weights} not found: base must be the dense model's directory")
    names = set(trained_tensor_names(student, trainable))
    reference = load_file(str(base_weights))
    state = student.state_dict()
    changed = [name for name, tensor in state.items() if name not in names
               and not torch.equal(tensor.detach().cpu(), reference[name].to(tensor.dtype))]
    if changed:
        raise ValueError(f"the student differs from the base weights {base_weights} outside its trainable part "
                         f"({trainable!r}), e.g. {changed[:3]}: it was not fine-tuned from this base with "
                         f"--trainable {trainable}")
    directory = Path(directory)
    save_safetensors_atomic({name: state[name].detach().to("cpu", dtype) for name in sorted(names)},
                            directory / STUDENT_WEIGHTS)
    record = {"sparse_config": sparse.to_dict(), "trainable": trainable, "dtype": str(dtype).replace("torch.", ""),
              "tensors": len(names), "parameters": sum(state[n].numel() for n in names),
              "base_sha256": file_sha256(base_weights), **(extra or {})}
    write_text_atomic(json.dumps(record, indent=2), directory / STUDENT_CONFIG)
    return directory


def export_sparse_student(run: str | Path, directory: str | Path, base: str | Path | None = None,
                          dtype: torch.dtype = torch.bfloat16) -> Path:
    """The student of a finished ``sparsevid distill`` output folder ``run`` as an asset in ``directory``
    (:func:`save_sparse_student`): its trainable part (from its recorded ``--trainable``) and its
    ``sparse_config.json``. ``base``: the dense model it was fine-tuned from (default: the shipped model).
    Returns ``directory``."""
    from .builtin import ASSETS, load_builtin
    from sparsevid.plan import SparseConfig
    from sparsevid.training.distill import SPARSE_CONFIG_FILE

    run = Path(run)
    sparse_file = run / SPARSE_CONFIG_FILE
    if not sparse_file.is_file():
        raise FileNotFoundError(f"{sparse_file} not found: run must be the folder of a finished sparse "
                                f"`sparsevid distill` run")
    student = load_builtin(run)
    summary = student.config.get("distillation")
    if not summary or "trainable" not in summary:
        raise ValueError(f"{run / 'builtin.json'} records no distillation run (no 'distillation' entry)")
    # The training phase as the run recorded it: objective, steps, batch, seconds, final loss.
    run = summary.get("run", {})
    run_info = {**{k: summary.get(k) for k in ("objective", "steps", "trainable", "seconds", "final_loss")},
                "batch_size": run.get("batch_size")}
    return save_sparse_student(student, SparseConfig.from_json(sparse_file.read_text()), summary["trainable"],
                               base if base is not None else ASSETS, directory, dtype=dtype,
                               extra={"run": run_info, "data": run.get("data")})
