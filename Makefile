# vllm-hybrid-spec: upstream vLLM v0.26.0 + patches/, see README.md
PYTHON ?= python3
VENV_PY := .venv/bin/python
# tests to run from fork/'s own tree (upstream tests for the code we patch)
UPSTREAM_TESTS := $(shell grep -v '^\s*\(#\|$$\)' tests/upstream-tests.txt)
PYTEST_ARGS ?=

.PHONY: help fetch sync export version wheel testbed fixtures lint test test-ours test-upstream bundle clean

help:
	@echo "make fetch | sync | export | wheel | test | lint | bundle | clean"

fetch:
	$(PYTHON) -m hsfork fetch

sync:
	$(PYTHON) -m hsfork sync

export:
	$(PYTHON) -m hsfork export

version:
	@$(PYTHON) -m hsfork version

testbed:
	$(PYTHON) -m hsfork.testbed

fixtures:
	$(PYTHON) -m hsfork fixtures

wheel: testbed
	$(VENV_PY) -m hsfork wheel --python $(abspath $(VENV_PY))

# CPU test suite: lint, our tests, then the fork's upstream tests for the code
# we patch.
test: testbed fixtures lint test-ours test-upstream

lint:
	$(VENV_PY) -m ruff check hsfork harness serving benchmarks tests
	$(VENV_PY) -m ruff format --check hsfork harness serving benchmarks tests

test-ours:
	$(VENV_PY) -m pytest tests $(PYTEST_ARGS)

test-upstream:
	cd fork && HF_HUB_OFFLINE=1 HF_HUB_CACHE=$(abspath .cache/hf/hub) \
	  CUDA_VISIBLE_DEVICES= TRITON_INTERPRET=1 VLLM_TARGET_DEVICE=empty \
	  PYTHONPATH=$(abspath .) ../$(VENV_PY) -m pytest -p no:cacheprovider -p hsfork.pytest_cpu_testbed $(UPSTREAM_TESTS) $(PYTEST_ARGS)

bundle: wheel
	$(VENV_PY) -m hsfork bundle

clean:
	rm -rf build dist .cache/hf
