"""The make targets run in the project's .venv after its set-up (the demo with the demo extras, the tests with the
test extras), the GPU tests as the CPU suite."""
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
    assert commands[0] == "bash scripts/setup.sh test"
    assert commands[-1].startswith(".venv/bin/python -m pytest")


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_the_demo_sets_up_only_what_it_needs():
    commands = subprocess.run(["make", "--no-print-directory", "-n", "demo"], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout.splitlines()
    assert commands == ["bash scripts/setup.sh demo", ".venv/bin/python -m sparsevid_lab demo"]


def test_both_set_ups_install_the_library_and_the_lab():
    """`make demo` and `make test` install the library and its lab (editable); the test set-up adds the test
    extras, so a .venv set up for the tests serves the demo too."""
    script = (ROOT / "scripts" / "setup.sh").read_text()
    assert '-e ".[test]" -e ./lab' in script and "-e . -e ./lab" in script
