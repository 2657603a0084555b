"""What every benchmark records about its run: the device, the library versions, the commit and the time."""
from __future__ import annotations

import datetime
import importlib
import importlib.metadata
import os
import platform
import subprocess
from pathlib import Path

import torch


def git_commit() -> str:
    """Short commit hash: $GIT_COMMIT when set (copies without .git), else ``git rev-parse``, else "unknown"."""
    if os.environ.get("GIT_COMMIT"):
        return os.environ["GIT_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True,
                                       cwd=Path(__file__).parent, stderr=subprocess.DEVNULL).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _version(module: str) -> str | None:
    """``module.__version__``, or None where it is not installed."""
    try:
        return importlib.import_module(module).__version__
    except ImportError:
        return None


def _distribution_version(name: str) -> str | None:
    """The installed version of distribution ``name`` without importing it, or None where it is not installed."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def recorded_args(args) -> dict[str, str]:
    """A command's parsed options as strings for its result record, less ``out``: where this run wrote says
    nothing about what it measured (and names a folder of the machine it ran on)."""
    return {k: str(v) for k, v in vars(args).items() if k != "out"}


def run_metadata(device: torch.device | str | None = None, **settings) -> dict:
    """The record every benchmark writes with its results: ``device`` (its type, "cuda" or "cpu"), ``gpu`` (the
    CUDA device's name, else the CPU's), ``torch``, ``triton`` and ``diffusers`` versions (None where not
    installed), ``flash_attn_4`` (its version where installed: ``backend="auto"`` then runs on it where it can),
    ``python``, ``commit`` (see :func:`git_commit`), ``time`` (UTC, ISO 8601), then the benchmark's
    own ``settings``. ``device``: the device measured; None means the current CUDA device when there is one,
    else the CPU."""
    device = torch.device(device) if device is not None else torch.device(
        "cuda" if torch.cuda.is_available() else "cpu")
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    return {"device": device.type, "gpu": gpu, "torch": torch.__version__, "triton": _version("triton"),
            "diffusers": _version("diffusers"), "flash_attn_4": _distribution_version("flash-attn-4"),
            "python": platform.python_version(), "commit": git_commit(),
            "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), **settings}
