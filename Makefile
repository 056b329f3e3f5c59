# vllm-hybrid-spec: upstream vLLM + patches/<version>/, see README.md.
# Every target acts on one line: BASE=current (default, upstream v0.33.0) or
# BASE=stable (upstream v0.26.0); `make lines` lists them. `make test` runs the
# CPU suite of both lines.
PYTHON ?= python3
BASE ?= current
export HSFORK_BASE := $(BASE)
HSFORK := $(PYTHON) -m hsfork
TAG = $(shell HSFORK_BASE=$(BASE) $(HSFORK) lines | awk '$$1 == "*" {print $$3}')
VENV_PY = .venv/$(TAG)/bin/python
# tests to run from the fork's own tree (upstream tests for the code we patch)
UPSTREAM_TESTS = $(shell grep -v '^\s*\(\#\|$$\)' patches/$(TAG)/upstream-tests.txt)
PYTEST_ARGS ?=

.PHONY: help lines fetch sync export version wheel testbed fixtures lint test \
	test-line test-ours test-upstream bundle torch-bundle clean pr

help:
	@echo "make [BASE=current|stable] lines | fetch | sync | export | version | wheel | test | lint | bundle | torch-bundle | pr | clean"

lines:
	@$(HSFORK) lines

fetch:
	$(HSFORK) fetch

sync:
	$(HSFORK) sync

export:
	$(HSFORK) export

version:
	@$(HSFORK) version

testbed:
	$(HSFORK) testbed

fixtures:
	$(HSFORK) fixtures

wheel: testbed
	$(VENV_PY) -m hsfork wheel --python $(abspath $(VENV_PY))

# The CPU test suite: lint and our tests once (on the current line's test
# bed), then each line's upstream-bound tests from inside its fork.
test: fixtures
	$(MAKE) BASE=current testbed lint test-ours test-upstream
	$(MAKE) BASE=stable testbed test-upstream

# one line only: its test bed, our tests and its upstream-bound tests
test-line: testbed fixtures lint test-ours test-upstream

lint:
	$(VENV_PY) -m ruff check hsfork harness serving benchmarks tests
	$(VENV_PY) -m ruff format --check hsfork harness serving benchmarks tests

test-ours:
	$(VENV_PY) -m pytest tests $(PYTEST_ARGS)

test-upstream:
	cd fork/$(TAG) && HF_HUB_OFFLINE=1 HF_HUB_CACHE=$(abspath .cache/hf/hub) \
	  CUDA_VISIBLE_DEVICES= TRITON_INTERPRET=1 VLLM_TARGET_DEVICE=empty \
	  PYTHONPATH=$(abspath .) ../../$(VENV_PY) -m pytest -p no:cacheprovider -p hsfork.pytest_cpu_testbed $(UPSTREAM_TESTS) $(PYTEST_ARGS)

# BUNDLE_ARGS: e.g. --requirement 'nvidia-cutlass-dsl[cu13]==4.8.0' (Kimi-Linear
# on v0.33.0) or --include moe (docs/gpu-host.md)
BUNDLE_ARGS ?=
bundle: wheel
	$(VENV_PY) -m hsfork bundle $(BUNDLE_ARGS)

# The torch/triton stack the line declares (v0.33.0: torch 2.14.0), pruned to
# sm_$(KEEP_SM) and split into uploads for the air-gapped GPU hosts, which have
# torch 2.11 (hsfork/stage_torch.py; docs/gpu-host.md).
# USE_HOST="--use-host nvidia-nccl-cu13" takes a library from the host anyway.
KEEP_SM ?= 90
USE_HOST ?=
torch-bundle:
	$(HSFORK) torch-bundle --keep-sm $(KEEP_SM) $(USE_HOST)

# The upstream PR package (docs/upstreaming.md): a branch and a description
# per patch in build/<tag>/pr/, with upstream's checks and red/green tests
# (CHECK= to skip them; PR_ARGS="--only 03,07" to check some).
SIGNOFF ?=
CHECK ?= --check
PR_ARGS ?=
pr:
	$(HSFORK) pr --signoff "$(SIGNOFF)" $(CHECK) $(PR_ARGS)

clean:
	rm -rf build dist .cache/hf
