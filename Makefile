# ddp-cluster: every command the README shows is a target here. `make help` lists them.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCHRUN := $(VENV)/bin/torchrun

WORKERS ?= 4        # ranks (processes) on this machine
STEPS ?= 20         # training steps of the demo
BUCKET_MB ?= 25     # DDP bucket size in MiB
DDP ?= scratch      # scratch (ours) | torch (torch.nn.parallel.DistributedDataParallel)
PYTEST_ARGS ?=

# One BLAS thread per rank: several ranks share this machine's cores, more threads only fight each other.
export OMP_NUM_THREADS ?= 1

.PHONY: help venv demo test bench accum clean

help: ## list the targets
	@grep -hE '^[a-z][a-z0-9-]*:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-14s %s\n", $$1, $$2}'

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet -e '.[test]'
	touch $@

venv: $(VENV)/.installed ## create the virtualenv and install the project (torch==2.13.0 CPU where the wheel is local)

demo: venv ## the proof: WORKERS CPU ranks under torchrun vs single-process training, step by step
	$(TORCHRUN) --standalone --nproc-per-node=$(strip $(WORKERS)) -m app.demo \
	  --steps $(strip $(STEPS)) --bucket-cap-mb $(strip $(BUCKET_MB)) --ddp $(strip $(DDP))

test: venv ## run the test suite
	$(PY) -m pytest $(PYTEST_ARGS)

bench: venv ## DDP step time side by side (ours vs torch's vs the lesson's loop), table + JSON in bench/results/
	$(TORCHRUN) --standalone --nproc-per-node=2 -m bench.ddp_bench

accum: venv ## gradient accumulation on 2 CPU ranks: equivalence, sync counts, sweep; JSON + PNG in bench/results/
	$(PY) -m bench.accum

.PHONY: k8s-validate k8s-emulate
k8s-validate: venv ## check k8s/ offline: API schemas, the Python client, the wiring (no cluster needed)
	$(PY) -m pytest tests/test_k8s.py $(PYTEST_ARGS)

k8s-emulate: venv ## run k8s/cpu/job.yaml's pods as Docker containers named like the pods (needs `make image`)
	$(PY) -m pytest tests/e2e/test_k8s_emulation.py $(PYTEST_ARGS)

# -- the cluster: one container per rank (docker/, compose.yaml; README section "cluster") ------------------------
# The official python:3.11-slim by default. On this project's machines and in CI no registry is reachable (they have
# ../shared/docker/setup-engine.sh): `make docker-setup` builds the stand-in local/python:3.11-slim and a wheelhouse,
# and compose.local.yaml replaces the images that cannot be pulled (Prometheus from Debian's package, no Grafana).
SETUP_ENGINE ?= ../shared/docker/setup-engine.sh
IMAGE ?= ddp-cluster:latest
BASE_IMAGE ?= $(if $(wildcard $(SETUP_ENGINE)),local/python:3.11-slim,python:3.11-slim)
TORCH_VARIANT ?= cpu
PIP_OFFLINE ?= $(if $(filter local/%,$(BASE_IMAGE)),1,0)
COMPOSE_FILE ?= compose.yaml$(if $(filter local/%,$(BASE_IMAGE)),:compose.local.yaml)
RUN_ID ?= run-$(shell date +%Y%m%d-%H%M%S)
export BASE_IMAGE COMPOSE_FILE

.PHONY: docker-setup image up down logs e2e
docker-setup: ## Docker engine + Compose v2 (+ local base image and docker/wheels/ where no registry is reachable)
	@if [ -x $(SETUP_ENGINE) ]; then WHEELS=$(CURDIR)/docker/wheels $(SETUP_ENGINE); \
	elif docker compose version >/dev/null 2>&1; then echo "docker-setup: docker and compose are there"; \
	else echo "docker-setup: install Docker with the Compose v2 plugin (docs.docker.com/engine/install)" >&2; exit 2; fi

image: ## build the worker image ddp-cluster:latest (BASE_IMAGE=..., TORCH_VARIANT=cpu|cuda|cu128)
	docker build -f docker/Dockerfile -t $(IMAGE) --build-arg BASE_IMAGE=$(BASE_IMAGE) \
	  --build-arg TORCH_VARIANT=$(TORCH_VARIANT) --build-arg PIP_OFFLINE=$(PIP_OFFLINE) .

up: ## start the cluster: WORKERS containers, one rank each, + Prometheus (127.0.0.1:9090) and Grafana (:3000)
	RUN_ID=$(RUN_ID) WORKERS=$(strip $(WORKERS)) docker compose up -d --build --scale worker=$(strip $(WORKERS))
	@echo "training under rendezvous id $(RUN_ID): make logs to follow, make down to stop and clean up"

down: ## stop the cluster and remove its containers, network and volumes (checkpoints, metrics)
	docker compose down -v --remove-orphans

logs: ## follow the cluster's logs
	docker compose logs -f

e2e: venv docker-setup ## the end-to-end tests: image, compose up --scale worker=4, Prometheus, every dashboard query
	$(PY) -m pytest -m e2e tests/e2e $(PYTEST_ARGS)

clean: ## remove the virtualenv and caches
	rm -rf $(VENV) .pytest_cache *.egg-info
