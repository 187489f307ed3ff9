# rljob-operator — every entry point a developer or CI needs.
SHELL := /bin/bash
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
export PYTHONPATH := $(CURDIR)/operator
CLUSTER_DIR ?= .cluster
NODES ?= 2
GPUS_PER_NODE ?= 8
HELM ?= $(HOME)/.cache/rljob/bin/helm-v3.22.0/helm

.PHONY: help install install-demo test test-unit test-agent test-e2e lint crds chart-lint images openapi cluster-up cluster-down cluster-status binaries demo bench chaos gpu-test clean

help:
	@grep -E '^[a-z-]+:.*?## ' $(MAKEFILE_LIST) | awk -F':.*?## ' '{printf "  %-14s %s\n", $$1, $$2}'

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# The frameworks' client packages, without their dependencies (pyproject.toml's `frameworks` extra says why
# and holds what their client modules import).
FRAMEWORK_CLIENTS := verl==0.9.1 areal==1.0.4 tensordict==0.10.0 pyvers==0.1.0

install: $(BIN)/python ## create .venv and install the package with the testing, train (torch), frameworks + dev extras, and SGLang's wheels
	$(BIN)/pip install -q -e '.[testing,dev,train,frameworks]'
	$(BIN)/pip install -q --no-deps $(FRAMEWORK_CLIENTS)
	bash hack/sglang-wheels.sh $(BIN)/python

install-demo: $(BIN)/python ## create .venv and install what the demo runs: the package and the testing extra (no torch, no SGLang wheels)
	$(BIN)/pip install -q -e '.[testing]'

test: install binaries ## unit, agent, e2e (real control plane), images (buildah); GPU tier skipped without a GPU
	$(BIN)/python -m pytest -q --durations=25 -n 2 --dist loadfile tests/unit tests/agent tests/e2e tests/images tests/gpu

test-unit: install ## pure tests only (seconds)
	$(BIN)/python -m pytest -q tests/unit

test-agent: install ## agent against the SGLang emulator
	$(BIN)/python -m pytest -q tests/agent

test-e2e: install binaries ## real kube-apiserver + etcd, helm, kubectl
	$(BIN)/python -m pytest -q tests/e2e

lint: install ## ruff + mypy (every product package) + lint-imports (the layers in .importlinter) + commit subjects
	$(BIN)/ruff check operator tests
	$(BIN)/mypy operator/rljob/api operator/rljob/lifecycle operator/rljob/agent operator/rljob/trainer operator/rljob/controller operator/rljob/cli operator/rljob/kubeclient operator/rljob/event_loop.py
	$(BIN)/lint-imports
	bash hack/commit-subjects.sh

crds: install ## regenerate crds/ (and the chart's copy) from the pydantic models
	$(BIN)/python -m rljob.api.crd > crds/rljob.io_rljobs.yaml
	cp crds/rljob.io_rljobs.yaml charts/rljob-operator/crds/rljob.io_rljobs.yaml

chart-lint: binaries ## helm lint the chart
	$(HELM) lint --strict charts/rljob-operator

images: ## build the operator, agent and testing images: docker if a daemon answers, else buildah (docs/images.md)
	bash hack/build-images.sh

openapi: install ## regenerate the agent's OpenAPI document
	$(BIN)/python -m rljob.agent.openapi > docs/agent-openapi.json

binaries: ## build (once, cached in ~/.cache/rljob) etcd, kube-apiserver/-scheduler/-controller-manager, kubectl, helm
	bash hack/build-binaries.sh

cluster-up: install binaries ## local control plane + fake kubelet (NODES x GPUS_PER_NODE GPUs); .cluster/kubeconfig
	$(BIN)/python -m rljob.testing.cluster up --dir $(CLUSTER_DIR) --nodes $(NODES) --gpus-per-node $(GPUS_PER_NODE)

cluster-down: ## stop the local control plane
	$(BIN)/python -m rljob.testing.cluster down --dir $(CLUSTER_DIR)

cluster-status: ## is the local control plane running?
	$(BIN)/python -m rljob.testing.cluster status --dir $(CLUSTER_DIR)

demo: install-demo binaries ## the whole loop on a real local API server with simulated GPUs
	$(BIN)/python -m rljob.testing.demo

bench: install binaries ## benchmarks: printed tables, not timed tests (agent overhead; decision cost; control overhead 1 to 512 pods, 100 jobs x 8)
	$(BIN)/python -m pytest -q -s -m bench tests/bench/bench_agent_overhead.py tests/bench/bench_decide.py tests/bench/bench_control_overhead.py

chaos: install binaries ## chaos suite (a report, not timed tests; ~5 min): operator, agent, engine, standby, API server faults
	$(BIN)/python tests/chaos/chaos.py

gpu-test: ## GPU tier (needs an NVIDIA GPU; see tests/gpu/README.md)
	$(BIN)/python -m pytest -q -s tests/gpu

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .mypy_cache .ruff_cache
