# batchknee — every entry point. `make test` is the one test command (CI runs it via .ci/run).
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
PYTHON ?= python3
VENV ?= .venv
BIN := $(CURDIR)/$(VENV)/bin
export PATH := $(BIN):$(PATH)

.PHONY: help venv lint test test-unit test-component demo clean crds

help:
	@echo "make demo   - the closed loop on an embedded local cluster"
	@echo "make test   - lint, type-check and every test tier"

venv: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $@

lint: venv
	ruff check operator tests
	ruff format --check operator tests
	mypy
	lint-imports

crds: venv
	mkdir -p crds
	batchknee crd > crds/batchknee.io_llmservings.yaml
	batchknee crd --peering > crds/kopf.dev_peerings.yaml

test-unit: venv
	pytest -q tests/unit

test-component: venv
	pytest -q tests/component

test: lint test-unit test-component

demo: venv
	batchknee plan --model llama-3-8b --gpu a100-80gb --params 8.0e9 --bandwidth 2.0TB/s \
	  --context 512,2048,8192 --batch 1,8,32,64,128,256

clean:
	rm -rf $(VENV) build dist demo-out .pytest_cache .mypy_cache .ruff_cache .hypothesis
