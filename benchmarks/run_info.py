"""What every benchmark records about the run: the git commit of the code it measured."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path


def git_commit() -> str:
    """Short commit hash: $GIT_COMMIT when set (copies without .git), else ``git rev-parse``, else "unknown"."""
    if os.environ.get("GIT_COMMIT"):
        return os.environ["GIT_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True,
                                       cwd=Path(__file__).parent, stderr=subprocess.DEVNULL).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
