"""The make targets run in the project's .venv after its set-up, the GPU tests as the CPU suite."""
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
@pytest.mark.parametrize("target", ["test", "gpu-test"])
def test_test_targets_set_up_and_use_the_venv(target):
    # --no-print-directory: under `make test` (as CI runs it) the nested make would announce its directory.
    commands = subprocess.run(["make", "--no-print-directory", "-n", target], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout.splitlines()
    assert commands[0] == "bash scripts/setup.sh"
    assert commands[-1].startswith(".venv/bin/python -m pytest")
