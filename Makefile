# Set-up and the project's gate. `make demo` and `make test` each set everything up first.
#   make demo    start local env servers and step a RemoteVectorEnv over them
#   make test    codegen freshness, lint, type-check, and the test suite (what CI runs)
PYTHON ?= python3
VENV   ?= .venv
# torch 2.13.0: the CPU wheel on machines that have it locally, the CUDA build from PyPI on a GPU host.
TORCH  ?= torch==2.13.0
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup demo test lint check

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(VENV)/bin/learner demo

lint: setup
	$(PY) proto/generate.py --check
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

test: lint
	$(PY) -m pytest
