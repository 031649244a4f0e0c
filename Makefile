# batchknee — every entry point. `make test` is the one test command (CI runs it via .ci/run).
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
PYTHON ?= python3
VENV ?= .venv
BIN := $(CURDIR)/$(VENV)/bin
export PATH := $(BIN):$(PATH)

.PHONY: help bench-scale venv wheelhouse lint test test-unit test-loopback test-component test-contract \
	contract-wheels test-package test-integration test-e2e tools \
	system-deps dev-cluster demo demo-fast bench clean crds chart-docs lock

help:
	@echo "make demo   - the closed loop on an embedded local cluster"
	@echo "make demo-fast - the same with short phases"
	@echo "make test   - lint, type-check and every test tier"
	@echo "make tools  - build the local control plane (kube-apiserver, etcd, kubectl, ...) and helm into bin/"
	@echo "make system-deps - install Prometheus (Debian package) when it is missing"
	@echo "make dev-cluster - a local cluster in the foreground; Ctrl-C stops it"
	@echo "make bench  - batchknee vs vLLM's default, best static and the oracle, in simulated time"
	@echo "make lock   - re-pin every Python dependency at its newest release (constraints.txt)"
	@echo "make crds   - regenerate crds/ and the chart's CRD templates from the API models"
	@echo "make chart-docs - regenerate the README's chart values and operator settings references"
	@echo "make test-contract - metric names against the engines' pinned releases (downloads their wheels once)"
	@echo "make test-package - the wheel installed the Dockerfile's way, helm lint/template of the chart"
	@echo "make bench-scale - one operator, 200 and 1,000 LLMServings on the local control plane (BENCH_SCALE_SIZES=200,1000)"

# Every Python distribution at the version constraints.txt pins (the set CI last passed with), so a
# release upstream changes neither a CI run nor the image until `make lock` takes it in.
venv: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -c constraints.txt --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[dev,demo]'
	touch $@

# Re-resolve every dependency (the base, dev, demo and plot extras) at its newest release into
# constraints.txt, in a throwaway venv; then `make test` says whether the new set passes.
lock:
	@scratch=$$(mktemp -d); trap 'rm -rf "$$scratch"' EXIT; \
	$(PYTHON) -m venv "$$scratch/venv"; \
	"$$scratch/venv/bin/python" -m pip install -q --upgrade pip; \
	"$$scratch/venv/bin/python" -m pip install -q '.[dev,demo,plot]'; \
	{ echo "# Every Python distribution batchknee, its tests and its image install, at the version last"; \
	  echo "# tested (\`make lock\` rewrites this file; \`make venv\` and the Dockerfile install with -c)."; \
	  "$$scratch/venv/bin/python" -m pip freeze --all --exclude batchknee; } > "$$scratch/constraints.txt"; \
	mv "$$scratch/constraints.txt" constraints.txt
	@echo "constraints.txt: $$(grep -vc '^#' constraints.txt) distributions pinned"

# The dependencies' wheels, fetched at install time so that tests/package can install the operator's
# wheel into a fresh venv offline, the way the Dockerfile's runtime stage does (--no-index --find-links),
# and then the demo extra on top of it. The base wheel's set stays in the image; the extra's is only here.
WHEELHOUSE := $(VENV)/wheelhouse
wheelhouse: $(WHEELHOUSE)/.done
$(WHEELHOUSE)/.done: pyproject.toml constraints.txt $(VENV)/.installed
	rm -rf $(WHEELHOUSE)
	$(BIN)/python -m pip wheel -q --wheel-dir $(WHEELHOUSE) --no-build-isolation -c constraints.txt '.[demo]'
	rm -f $(WHEELHOUSE)/batchknee-*.whl
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
	batchknee crd --requester-policy > crds/batchknee.io_llmservings-requester-policy.yaml
	mkdir -p charts/batchknee/templates/crds
	batchknee crd --chart > charts/batchknee/templates/crds/batchknee.io_llmservings.yaml
	batchknee crd --chart --peering > charts/batchknee/templates/crds/kopf.dev_peerings.yaml
	batchknee crd --chart --requester-policy > charts/batchknee/templates/crds/batchknee.io_llmservings-requester-policy.yaml

# The README's chart values reference, from the `# --` comments in charts/batchknee/values.yaml,
# and its operator settings reference, from batchknee.settings.
chart-docs: venv
	$(BIN)/python tests/support/chart_values_doc.py --write README.md
	$(BIN)/python tests/support/settings_doc.py --write README.md

test-unit: venv
	pytest -q tests/unit

# Servers, clients, subprocesses and network namespaces on loopback; no cluster.
test-loopback: venv
	pytest -q tests/loopback

test-component: venv
	pytest -q tests/component

# The engines' released wheels the metric contract is pinned to (tests/contract/wheels.py: PINNED),
# downloaded without dependencies into ${XDG_CACHE_HOME:-~/.cache}/batchknee/wheels/<name>-<version>/
# on a cold machine; a warm cache downloads nothing.
contract-wheels: venv
	$(BIN)/python tests/contract/wheels.py fetch

# The adapter's queries and the emulator's /metrics against the metrics the pinned vLLM and SGLang
# releases register (read from their wheels with ast, never imported) and TensorRT-LLM's collector
# pinned by commit.
test-contract: venv contract-wheels
	pytest -q -m contract tests/contract

# The local control plane: one multicall binary from k8s.io/kubernetes plus helm, built once per
# content key into ${XDG_CACHE_HOME:-~/.cache}/batchknee/tools/<key>/ and linked into bin/.
tools:
	tools/build.sh

# Debian's prometheus for the integration tier, and iproute2's `ip` for the e2e tier's and the
# demo's private network namespace (util-linux's `unshare` is essential in Debian). Only installs
# what is missing; CI runs as root. --no-install-recommends keeps prometheus-node-exporter out.
# Tests never use the packaged service (if the package starts one on :9090): they run their own on
# a free loopback port.
system-deps:
	@missing=; \
	command -v prometheus >/dev/null && command -v promtool >/dev/null || missing="$$missing prometheus"; \
	command -v ip >/dev/null || missing="$$missing iproute2"; \
	if [ -z "$$missing" ]; then \
	  echo "system-deps: $$(command -v prometheus), $$(command -v promtool) and $$(command -v ip) present"; \
	else \
	  sudo=; [ "$$(id -u)" = 0 ] || sudo=sudo; \
	  $$sudo apt-get update -q && \
	  DEBIAN_FRONTEND=noninteractive $$sudo apt-get install -y -q --no-install-recommends $$missing; \
	fi

# The Dockerfile's steps without Docker (wheel → fresh venv → the console script) and the Helm chart
# (helm lint, helm template with several value sets, the dashboard, the CRD copy).
test-package: venv tools wheelhouse
	pytest -q tests/package

# Each file's tests on one of two local clusters at once (pytest-xdist, --dist loadfile: a module's
# fixtures are set up once): the tier waits on intervals and scrapes far more than it computes. (Not
# the e2e tier: its client times TPOT by the wall clock, and two demo worlds at once on 2 cores put
# that 26-43 % off the engines' own histograms.)
CLUSTER_TEST_WORKERS ?= 2
test-integration: venv tools system-deps
	pytest -q -m integration --timeout=300 -n $(CLUSTER_TEST_WORKERS) --dist loadfile tests/integration

# The closed loop: the fast demo scenario on the local cluster, asserted (about 5 minutes). Inside a
# network namespace of its own (pods on 10.x there, so the engine Service has endpoints), or on
# loopback with a note where the machine allows none.
test-e2e: venv tools system-deps
	$(BIN)/python -m batchknee.devcluster.in_netns pytest -q -m e2e --timeout=900 -p no:cacheprovider tests/e2e

test: lint test-unit test-loopback test-component test-contract test-package test-integration test-e2e

dev-cluster: venv tools system-deps
	batchknee dev-cluster up --with-prometheus

# The main job: the operator retuning emulated engines on an embedded local cluster as traffic
# shifts (about 9 minutes); demo-fast runs the same scenario with short phases (about 6–7 minutes).
demo: venv tools system-deps
	batchknee demo --out demo-out

demo-fast: venv tools system-deps
	batchknee demo --fast --out demo-out

# batchknee's closed loop against vLLM's default, the best static value and the per-phase oracle on
# four one-hour traces, in simulated time (no cluster; several minutes). Not part of `make test`.
BENCH_ENGINE := --model llama-3-8b --gpu a100-80gb --overhead-ms 2 --bandwidth-efficiency 0.8
bench: venv
	mkdir -p bench-out
	batchknee bench $(BENCH_ENGINE) --plot bench-out/bench.png --json-file bench-out/bench.json
	batchknee bench $(BENCH_ENGINE) --actuation live --plot bench-out/bench-live.png --json-file bench-out/bench-live.json

clean:
	rm -rf $(VENV) bin build dist demo-out bench-out .pytest_cache .mypy_cache .ruff_cache .hypothesis

# The scale benchmark (not part of `make test`): prints figures, asserts nothing.
BENCH_SCALE_SIZES ?= 200,1000
bench-scale: venv tools
	$(BIN)/python tests/bench/scale.py --sizes $(BENCH_SCALE_SIZES)
