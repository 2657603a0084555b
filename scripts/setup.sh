#!/usr/bin/env bash
# Creates .venv (seeing any torch already installed on the system) and installs sparsevid with the extras that
# the demo and the tests need (`.[test]`; `.[all]` adds the text-encoder stack of real diffusers pipelines).
# If no torch is importable, installs torch 2.13.0 (on machines that ship its CPU wheel locally, that one).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
# Install sparsevid and its extras once per version of pyproject.toml (the stamp records which); a matching
# stamp means the set-up is complete, so later runs start at once (no torch import to check).
stamp=.venv/.sparsevid-installed
wanted=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ -x .venv/bin/python ] && [ "$(cat "$stamp" 2>/dev/null)" = "$wanted" ]; then
    exit 0
fi
if [ ! -x .venv/bin/python ]; then
    if "$PYTHON" -m pip --version >/dev/null 2>&1; then
        "$PYTHON" -m venv --without-pip --system-site-packages .venv  # the system's pip serves it: no bootstrap
    else
        "$PYTHON" -m venv --system-site-packages .venv
    fi
fi
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    .venv/bin/python -m pip install -q "torch==2.13.0"
fi
if [ "$(cat "$stamp" 2>/dev/null)" != "$wanted" ]; then
    .venv/bin/python -m pip install -q -e ".[test]"  # what `make demo` and `make test` need
    echo "$wanted" > "$stamp"
fi
