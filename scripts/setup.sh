#!/usr/bin/env bash
# Creates .venv (seeing any torch already installed on the system) and installs sparsevid and its lab (lab/,
# editable) with what a make target needs: `bash scripts/setup.sh demo` (the lab with the library's runtime extras,
# for `make demo`) or `bash scripts/setup.sh test` (the default: that plus the test extras, for `make test`). If no torch is importable, installs torch 2.13.0 (on
# machines that ship its CPU wheel locally, that one).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
EXTRAS=${1:-test}
case "$EXTRAS" in demo|test) ;; *) echo "usage: scripts/setup.sh [demo|test]" >&2; exit 2 ;; esac
# Install once per version of pyproject.toml and extras (the stamp records which); a matching stamp, or one of
# the test extras (a superset), means the set-up is complete, so later runs start at once (no torch import).
stamp=.venv/.sparsevid-installed
version=$(cat pyproject.toml lab/pyproject.toml | sha256sum | cut -d' ' -f1)
installed=$(cat "$stamp" 2>/dev/null || true)
if [ -x .venv/bin/python ] && { [ "$installed" = "$version $EXTRAS" ] || [ "$installed" = "$version test" ]; }; then
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
if [ "$EXTRAS" = test ]; then
    .venv/bin/python -m pip install -q -e ".[test]" -e ./lab
else
    .venv/bin/python -m pip install -q -e . -e ./lab
fi
echo "$version $EXTRAS" > "$stamp"
