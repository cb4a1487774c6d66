# hermes-lab front door. Every target creates/reuses the local virtualenv .venv first, so a fresh clone
# needs nothing but `make round` (the main job) or `make test` (the suite).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PARAMS ?= params/embedded.yaml
# make live-demo: the real Hermes Agent's own loop plays the agent episodes (hermes_lab.agents); RUNNER=builtin: the
# stand-in's client-side loop, for a machine where Hermes or bubblewrap cannot be installed
RUNNER ?= hermes
ROUNDS ?= 3
# DEBUG=1: library logging and every warning too (hermes-lab --debug), also inside the stage kernels
HL := $(BIN)/hermes-lab $(if $(DEBUG),--debug)

.PHONY: setup round flywheel status serve live live-demo test test-fast pyc lint browser-deps sandbox-deps lab mlflow-ui bench clean-runs

setup: $(STAMP)

# torch first, from requirements/torch-cpu.txt: the CPU wheel. Installing the package afterwards finds
# torch satisfied and never pulls a CUDA build. GPU users: see docs/gpu.md. requirements/install.py installs
# with uv (pip's versions and sources, ~25 s instead of ~3.5 min), pip where uv fails
$(STAMP): pyproject.toml requirements/torch-cpu.txt requirements/constraints.txt requirements/install.py
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip uv
	$(BIN)/python requirements/install.py
	$(BIN)/python -m ipykernel install --sys-prefix --name hermes-lab --display-name "hermes-lab (.venv)" >/dev/null
	touch $(STAMP)

## main job: one full round on the embedded default (offline, CPU)
round: setup sandbox-deps
	$(HL) round --params $(PARAMS)

## the loop, unattended, on a simulated clock
flywheel: setup sandbox-deps
	$(HL) flywheel --params $(PARAMS) --rounds $(ROUNDS)

status: setup
	$(HL) status --params $(PARAMS)

## the live A/B gateway on 127.0.0.1:8700: baseline embedded:tiny, candidate the latest round's adapter (else an A/A)
serve: setup
	$(BIN)/hermes-lab serve --params $(PARAMS)

## the live flywheel: one gateway on 127.0.0.1:8700 that stays up; rounds start on its traffic, candidates swap in
## (send traffic: hermes-lab agent --url http://127.0.0.1:8700 --requests 500; status page: http://127.0.0.1:8700/)
live: setup sandbox-deps
	$(HL) flywheel --live --params $(PARAMS)

## the live flywheel on a 360x clock with the real Hermes Agent as traffic: two rounds start themselves, swap in, are
## decided live
live-demo: setup sandbox-deps
	$(BIN)/python -m hermes_lab.round.live_demo --params $(PARAMS) --runner $(RUNNER)

## the suite on every core, and two workers more (pytest-xdist: whole files per worker, the longest first:
## tests/conftest.py). Many tests wait (servers starting, a rollout's wall-clock stages, a killed process's
## restart): with one worker a core, 10% of the CPU stayed idle; two more keep it busy (on 2 cores, 4 workers
## took 776 s where 3 took 876).
## On a fresh clone the tiny policy most tests share builds in the background while the files that need none run;
## the 15 slowest tests are listed at the end (where the time goes)
WORKERS ?= $(shell echo $$(( $$(nproc) + 2 )))
## PYTHONDONTWRITEBYTECODE (set on this machine and CI) is cleared for the suite: each worker rewrote the asserts
## of every test module at collection (~4 s of CPU each), and test helpers were compiled in every subprocess
test: setup lint browser-deps sandbox-deps pyc
	PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest -q -n $(WORKERS) --dist loadfile --no-loadscope-reorder --durations=15 tests

## Chromium + chromedriver for the browser tests: apt-get installs them when missing and run as root (CI);
## elsewhere the browser tests skip and say why
browser-deps:
	@sh tests/browser_deps.sh

## the local sandbox's system packages: bubblewrap (each run's root of its own) and libseccomp (its seccomp filter),
## installed with apt-get when missing and run as root; elsewhere it says what to install (hermes-lab doctor: the layers)
sandbox-deps:
	@sh requirements/sandbox-deps.sh

## hermes_lab's bytecode, written once: where PYTHONDONTWRITEBYTECODE is set (this machine, CI) no process writes it,
## and each of the suite's ~200 processes (stage kernels, CLIs, servers) compiled the package anew (~0.2 s of CPU)
pyc: setup
	@$(BIN)/python -m compileall -q hermes_lab

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports --no-cache

## the loop of a change, on every core: every folder of tests/ but e2e/ (the slow end-to-end tests: whole rounds, the
## live flywheel, the real Hermes Agent, the browser), and in the others the tests marked slow left out too (a real
## training, a stage notebook: test_train's, test_validate's, ... kept beside their package's fast tests)
test-fast: setup sandbox-deps pyc
	PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest -q -n $(WORKERS) --dist loadfile --no-loadscope-reorder --ignore=tests/e2e -m "not slow" tests

## JupyterLab on the project root, opening notebooks/README.md (hermes_lab/cli/lab.py)
lab: setup
	$(HL) lab

mlflow-ui: setup
	$(BIN)/mlflow ui --backend-store-uri sqlite:///runs/mlflow.db --host 127.0.0.1 --port 5000

bench: setup sandbox-deps
	for b in benchmarks/bench_*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

clean-runs:
	rm -rf runs/round-* runs/state.json runs/mlflow.db runs/mlartifacts
