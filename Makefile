# Set-up and the project's gate. `make train`, `make demo` and `make test` each set everything up first.
#   make train   train PPO on CartPole-v1 to solved through 2 local env servers x 4 envs, write a run dir
#                with its plot, then evaluate the policy and record an episode as a GIF
#                (`make train ARGS="--seed 2"` passes options on, `make train RUN=DIR` picks the run dir)
#   make demo    start local env servers and step a RemoteVectorEnv over them
#   make test    codegen freshness, lint, type-check, and the test suite (what CI runs;
#                `make test PYTEST_ARGS="-n 4 --dist loadfile"` changes its workers)
#   make lint    codegen freshness, lint and type-check alone;  make fmt  formats the code as lint wants
#   make quick   the tests not marked slow, docker or netns (~3 min instead of 13-16; no lint): the loop
#                while changing code, before `make test`
PYTHON ?= python3
VENV   ?= .venv
# torch 2.13.0: the CPU wheel on machines that have it locally, the CUDA build from PyPI on a GPU host.
TORCH  ?= torch==2.13.0
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
RUN    ?= runs/CartPole-v1-$(shell date +%Y%m%d-%H%M%S)
ARGS   ?=
# 2 workers, each taking a whole test module (its module-scoped servers and containers start once):
# 13-16 min instead of ~22 on the 2-core development machine.
PYTEST_ARGS ?= -n 2 --dist loadfile

.PHONY: setup train demo test quick lint fmt

$(STAMP): pyproject.toml Makefile
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11) and f"make setup: envfleet needs Python 3.11 or newer; $(PYTHON) is {sys.version.split()[0]} (give another: make setup PYTHON=python3.11)")'
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	# (the clone on sys.path by a .pth file, which type checkers and IDEs follow: pyproject.toml's package-dir)
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

setup: $(STAMP)

train: setup
	$(VENV)/bin/learner train --env CartPole-v1 --stop-at-return 475 --run-dir $(RUN) $(ARGS)
	$(VENV)/bin/learner eval --checkpoint $(RUN) --episodes 10 --video $(RUN)/episode.gif

demo: setup
	$(VENV)/bin/learner demo

lint: setup
	$(PY) proto/generate.py --check
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

fmt: setup
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

test: lint
	# (the slowest tests go to CI's log)
	$(PY) -m pytest $(PYTEST_ARGS) --durations=30

quick: setup
	$(PY) -m pytest $(PYTEST_ARGS) -m "not slow and not docker and not netns"
