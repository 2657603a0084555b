# The two commands: `make demo` (main job) and `make test` (test suite); `make gpu-test` runs the GPU tests
# (CUDA machine). Each sets up .venv on first use.
VENV_PY := .venv/bin/python

.PHONY: setup demo test gpu-test

setup:
	@bash scripts/setup.sh test

demo:
	@bash scripts/setup.sh demo
	$(VENV_PY) -m sparsevid demo

test: setup
	$(VENV_PY) -m pytest -q tests

gpu-test: setup
	$(VENV_PY) -m pytest -q -m gpu tests
