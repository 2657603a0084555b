# The two commands: `make demo` (main job: the lab's demo on the built-in model) and `make test` (library and lab
# tests); `make gpu-test` runs the GPU tests (CUDA machine). Each sets up .venv on first use.
VENV_PY := .venv/bin/python

.PHONY: setup demo test gpu-test

setup:
	@bash scripts/setup.sh test

demo:
	@bash scripts/setup.sh demo
	$(VENV_PY) -m sparsevid_lab demo

test: setup
	$(VENV_PY) -m pytest -q tests lab/tests

gpu-test: setup
	$(VENV_PY) -m pytest -q -m gpu tests lab/tests
