# Two commands on a fresh machine: `make demo` and `make test`. Each installs what it needs.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-dev
BENCH_STAMP := $(VENV)/.installed-bench
export PYTHONUNBUFFERED := 1

.PHONY: install test lint typecheck pytest demo proto bench clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, pinned: on these machines it resolves to the CPU wheel on disk instead of GBs of CUDA packages.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

$(BENCH_STAMP): $(STAMP)
	$(PY) -m pip install -q -e '.[dev,bench]'
	touch $@

install: $(STAMP)

lint: install
	$(VENV)/bin/ruff check .

typecheck: install
	$(VENV)/bin/mypy service worker

pytest: install
	$(VENV)/bin/pytest -q -ra $(PYTEST_ARGS)

test: lint typecheck pytest

demo: install
	$(VENV)/bin/grpo demo

proto: install
	$(PY) proto/generate.py

bench: $(BENCH_STAMP)
	$(PY) bench/grpo_step.py

clean:
	rm -rf $(VENV) grpo-data demo-out .mypy_cache .ruff_cache .pytest_cache
