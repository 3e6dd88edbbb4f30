# ddp-cluster: every command the README shows is a target here. `make help` lists the ones to start with, by group;
# `make help-all` every one (tools/make_help.awk).
##@ use: on this machine, CPU ranks
##@ cluster: one container per rank (Docker Compose)
##@ check: the tests, the lint, the long drills
##@ bench: benchmarks (JSON in bench/results/) and the docs' tables rendered from them
##@ dev: the project itself
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCHRUN := $(VENV)/bin/torchrun

WORKERS ?= 4        # ranks (processes) on this machine
STEPS ?= 20         # training steps of the demo
BUCKET_MB ?= 25     # DDP bucket size in MiB
WRAPPER ?= ours     # ours (app.parallel.ddp) | torch (torch.nn.parallel.DistributedDataParallel)
PYTEST_ARGS ?=
# pytest-xdist workers of `make test` (0: one process). 3, what CI runs: the Docker tests in one lane, mostly
# waiting on containers, beside two CPU-bound lanes (docs/development.md). Tests sharing one cluster start-up stay on
# one worker (tests/conftest.py).
TEST_WORKERS ?= 3

# One BLAS thread per rank: several ranks share this machine's cores, more threads only fight each other.
export OMP_NUM_THREADS ?= 1

.PHONY: help help-all venv demo test test-fast lint bench accum clean

help: ### dev: the targets to start with, by group
	@awk -f tools/make_help.awk $(MAKEFILE_LIST)

help-all: ### dev: every target, by group
	@awk -v all=1 -f tools/make_help.awk $(MAKEFILE_LIST)

# --no-compile: pip would byte-compile every module it installs, torch's included, on the critical path of every new
# machine and of CI. The import after it compiles (and caches) only the modules the project's processes import, also
# where PYTHONDONTWRITEBYTECODE is set, which would otherwise make every process compile them again.
WARM_IMPORTS := torch, torch.distributed.run, torch.distributed.pipelining, torch.distributed.fsdp, \
  torch.distributed.algorithms.ddp_comm_hooks, torch.distributed.optim, torch._dynamo, torch._inductor.compile_fx, \
  kubernetes.client, kubernetes_validate, matplotlib.pyplot, prometheus_client, yaml, pytest, xdist
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --no-compile -e '.[test]'
	PYTHONDONTWRITEBYTECODE= MPLBACKEND=Agg $(VENV)/bin/python -c 'import $(WARM_IMPORTS)'
	touch $@

venv: $(VENV)/.installed ## dev: create the virtualenv and install the project (torch==2.13.0 CPU where the wheel is local)

demo: venv ## use: the proof: WORKERS CPU ranks under torchrun vs single-process training, step by step
	$(TORCHRUN) --standalone --nproc-per-node=$(strip $(WORKERS)) -m app.demos.demo \
	  --steps $(strip $(STEPS)) --bucket-cap-mb $(strip $(BUCKET_MB)) --wrapper $(strip $(WRAPPER))

STAGE ?= 2            # ZeRO stage of `make zero`: 1 (optimizer state) | 2 (+ gradients) | 3 (+ parameters)
.PHONY: zero
zero: venv ## use: ZeRO stage STAGE on WORKERS CPU ranks vs one process and our DDP, step by step; PASS/FAIL (docs/sharding.md)
	$(TORCHRUN) --standalone --nproc-per-node=$(strip $(WORKERS)) -m app.demos.zero_demo --stage $(strip $(STAGE))

# `make check MODEL_SPEC=mypkg.models:build CHECK_ARGS="--data mypkg.data:build --accum 2"`: before a long job.
MODEL_SPEC ?= mini_mlp  # package.module:callable returning an nn.Module, or mini_mlp | deep_mlp | tiny_transformer
CHECK_ARGS ?=           # any other flags of app.check, e.g. "--ranks 4 --accum 2 --eval"; python -m app.check --help
.PHONY: check
check: venv ## use: does MODEL_SPEC train the same on N CPU ranks as on one process? table, diagnosis (docs/check.md)
	$(PY) -m app.check $(strip $(MODEL_SPEC)) $(CHECK_ARGS)

# `make plan MODEL_SPEC=mypkg.models:build PLAN_ARGS="--world 2,4,8 --memory 2g"`: which kinds fit, before launch.
PLAN_ARGS ?= --world 2,4  # any other flags of app.plan, e.g. "--memory 1300m --micro-batch 16"; python -m app.plan --help
.PHONY: plan bench-memory
plan: venv ## use: predicted peak memory per rank of ddp and ZeRO 1-3 for MODEL_SPEC, per world size; FITS (docs/sharding.md)
	$(PY) -m app.plan $(strip $(MODEL_SPEC)) $(PLAN_ARGS)

bench-memory: venv ### bench: each kind's peak RSS per rank of the real worker and its phase, worlds 2 and 4; JSON in bench/results/
	$(PY) -m bench.memory_bench

test: venv ## check: the test suite: unit, integration (real gloo ranks, Prometheus), e2e (Docker); not the drills, chaos run, GPU
	$(PY) -m pytest -n $(strip $(TEST_WORKERS)) --dist loadgroup $(PYTEST_ARGS)

test-fast: venv ## check: the unit tests only (one process, no network)
	$(PY) -m pytest tests/unit $(PYTEST_ARGS)

# Formatting is checked on Python files only: ruff would also reflow the code blocks of the docs, laid out by hand.
lint: venv ## check: ruff: lint and format check (what .ci/run runs first)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check --extend-exclude '*.md' .

bench: venv ## bench: DDP step time side by side (ours vs torch's vs the lesson's loop), table + JSON in bench/results/
	$(TORCHRUN) --standalone --nproc-per-node=2 -m bench.ddp_bench

.PHONY: gpu-check
GPU_CHECK_ARGS ?=    # e.g. GPU_CHECK_ARGS="--steps 30 --out /tmp/gpu.json" (tests/gpu/gpu_check.py)
gpu-check: venv ## check: ONE GPU: ours vs torch's DDP on NCCL, CUDA timings, hooks, train+resume on cuda; JSON + table
	GPU_CHECK_ARGS="$(GPU_CHECK_ARGS)" $(PY) -m pytest -m gpu tests/gpu -s -rs -p no:cacheprovider $(PYTEST_ARGS)

accum: venv ### bench: gradient accumulation on 2 CPU ranks: equivalence, sync counts, sweep; JSON + PNG in bench/results/
	$(PY) -m bench.accum

.PHONY: pipeline pipeline-bubble
pipeline: venv ## use: model parallel, GPipe, 1F1B, data x pipeline vs single-process training, step by step; bubble table
	$(PY) -m app.demos.pipeline_demo

pipeline-bubble: venv ### bench: pipeline idle share per stage vs (S-1)/(M+S-1), S=2,4 M=1..16, per-phase profile; JSON + PNG in bench/results/
	$(PY) -m bench.pipeline_bubble

.PHONY: scaling
scaling: venv ### bench: alpha-beta fit of gloo collectives (worlds 2-4); DDP step time predicted to 1024 ranks; JSON + PNG
	$(PY) -m bench.scaling

.PHONY: docs-config
docs-config: venv ### dev: rewrite docs/training.md's configuration table from TrainConfig (app/worker/config/schema.py)
	$(PY) -m tools.config_table

# -- the training worker on this machine (app/train.py; README section "training") ---------------------------------
# `make run STEPS=100` works too: STEPS is the demo's (20) unless given on the command line or in the environment.
RUN_STEPS ?= $(if $(filter command line environment,$(origin STEPS)),$(STEPS),300)
MODEL ?= mini_mlp   # mini_mlp | tiny_transformer
METRICS_PORT ?= 9400 # rank r serves http://localhost:<METRICS_PORT + r>/metrics; 0 = no metrics
CHECKPOINT_DIR ?=    # e.g. /tmp/ckpt: checkpoints there, Ctrl-C saves one, the next `make run` resumes
RUN_ARGS ?=          # any other flags of app.train, e.g. RUN_ARGS="--effective-batch 256 --lr 0.01"

.PHONY: run bench-metrics
run: venv ## use: train WORKERS ranks under torchrun here: progress from rank 0, live /metrics per rank (RUN_STEPS, MODEL)
	$(TORCHRUN) --standalone --nproc-per-node=$(strip $(WORKERS)) -m app.train --model $(strip $(MODEL)) \
	  --steps $(strip $(RUN_STEPS)) --wrapper $(strip $(WRAPPER)) --bucket-cap-mb $(strip $(BUCKET_MB)) \
	  --metrics-port $(strip $(METRICS_PORT)) $(if $(strip $(CHECKPOINT_DIR)),--checkpoint-dir $(strip $(CHECKPOINT_DIR))) \
	  $(RUN_ARGS)

.PHONY: bench-activation-checkpointing
bench-activation-checkpointing: venv ### bench: peak RSS and step time, activation_checkpointing off/units/every:2 (1 rank); JSON in bench/results/
	$(PY) -m bench.activation_checkpointing

bench-metrics: venv ### bench: step time with Prometheus metrics on vs off (2 ranks, interleaved); JSON in bench/results/
	$(PY) -m bench.metrics_overhead

# Benchmarks record their commit, settings and machine load (tools/provenance.py); the docs' tables are rendered from
# the committed JSON, and tests/unit/test_bench_report.py fails when they drift apart.
.PHONY: world-drift
DRIFT_ARGS ?=        # e.g. DRIFT_ARGS="--steps 100 --worlds 4 2": a trial, written to runs/ (tests/integration/world_drift.py)
world-drift: venv ### check: how far correct runs on 4 and on 3 ranks drift apart, float32 vs float64 (why chaos uses float64)
	DRIFT_ARGS="$(DRIFT_ARGS)" $(PY) -m pytest -m drift tests/integration/test_world_drift.py -s $(PYTEST_ARGS)

.PHONY: bench-report mutants mutants-curated
MUTANTS_ARGS ?=      # e.g. MUTANTS_ARGS="--seed 7 --sample 20 --jobs 2"; --list shows the sample (tools/mutation.py)
CURATED_ARGS ?=      # e.g. CURATED_ARGS="--only ckpt-no-fsync --timeout 300"; --list shows the names
bench-report: venv ## bench: rewrite the docs' generated tables from bench/results/*.json
	$(PY) -m tools.report

mutants: venv ### check: both measures of the tests, in a copy: a seeded sample of generated mutants, then the curated list
	@status=0; $(PY) -m tools.mutation $(MUTANTS_ARGS) || status=1; \
	  $(PY) -m tools.mutants $(CURATED_ARGS) || status=1; exit $$status

mutants-curated: venv ### check: the hand-kept one-line bugs of tools/mutants.py, each vs the tests meant to catch it; score
	$(PY) -m tools.mutants $(CURATED_ARGS)

.PHONY: k8s-validate k8s-emulate k8s-rules
k8s-validate: venv ### check: check what `kubectl apply -f k8s/` and each `apply -k k8s/<dir>/` send: schemas, client, wiring
	$(PY) -m pytest tests/unit/test_k8s.py $(PYTEST_ARGS)

RULE := k8s/monitoring/prometheusrule.yaml
k8s-rules: ### dev: rewrite $(RULE) below `spec:` from docker/prometheus/alerts.yml and recording.yml (comments kept)
	sed '/^spec:/q' $(RULE) > $(RULE).tmp
	sed -n '/^groups:/,$$p' docker/prometheus/alerts.yml | sed 's/^\(.\)/  \1/' >> $(RULE).tmp
	echo >> $(RULE).tmp
	sed -n '/^groups:/,$$p' docker/prometheus/recording.yml | tail -n +2 | sed 's/^\(.\)/  \1/' >> $(RULE).tmp
	mv $(RULE).tmp $(RULE)

k8s-emulate: venv image ### check: run the k8s/cpu/ render's pods for real: Docker containers named like the pods
	$(PY) -m pytest tests/e2e/test_k8s_emulation.py $(PYTEST_ARGS)

# -- the cluster: one container per rank (docker/, compose.yaml; README section "cluster") ------------------------
# The official python:3.11-slim by default. On this project's machines and in CI no registry is reachable (they have
# ../shared/docker/setup-engine.sh): `make docker-setup` builds the stand-in local/python:3.11-slim and a wheelhouse,
# and compose.local.yaml replaces the images that cannot be pulled (Prometheus from Debian's package, no Grafana).
SETUP_ENGINE ?= ../shared/docker/setup-engine.sh
BASE_IMAGE ?= $(if $(wildcard $(SETUP_ENGINE)),local/python:3.11-slim,python:3.11-slim)
TORCH_VARIANT ?= cpu
COMPOSE_FILE ?= compose.yaml$(if $(filter local/%,$(BASE_IMAGE)),:compose.local.yaml)
export BASE_IMAGE COMPOSE_FILE
# `make image` and `up` both build with Compose (BuildKit in the engine; `docker build` here is the legacy builder):
# one build cache. No buildx here, so no Bake.
export COMPOSE_BAKE ?= false

.PHONY: docker-setup image up down logs e2e chaos drills bench-startup
docker-setup: ### cluster: Docker engine + Compose v2 (+ local base image and docker/wheels/ where no registry is reachable)
	@if [ -f $(SETUP_ENGINE) ]; then WHEELS=$(CURDIR)/docker/wheels bash $(SETUP_ENGINE); \
	elif docker compose version >/dev/null 2>&1; then echo "docker-setup: docker and compose are there"; \
	else echo "docker-setup: install Docker with the Compose v2 plugin (docs.docker.com/engine/install)" >&2; exit 2; fi

image: ## cluster: build the worker image <project>:IMAGE_TAG (ddp-cluster:latest; BASE_IMAGE=..., TORCH_VARIANT=cpu|cuda|cu128)
	TORCH_VARIANT=$(TORCH_VARIANT) IMAGE_TAG=$(or $(strip $(IMAGE_TAG)),latest) docker compose build worker

MAX_WORKERS ?= 8    # the elastic world's maximum (torchrun --nnodes=1:MAX_WORKERS in compose.yaml)
# compose.yaml passes every setting's DDP_* of the shell to the workers; `make up` also writes all of them, whatever
# the name, to this file (app/cluster/compose_env.py), so that one that is no setting stops the workers with "did you
# mean". Each `up` writes it anew and `down` removes it: a plain `docker compose up` never reads it.
CLUSTER_ENV_FILE ?= .cluster.env
export MAX_WORKERS CLUSTER_ENV_FILE
up: ## cluster: start the cluster: WORKERS containers (1..MAX_WORKERS), one rank each, + Prometheus (:9090) and Grafana (:3000); DDP_*=... settings
	@if ! [ "$(strip $(WORKERS))" -ge 1 -a "$(strip $(WORKERS))" -le "$(strip $(MAX_WORKERS))" ] 2>/dev/null; then \
	  echo "WORKERS=$(strip $(WORKERS)): give 1..$(strip $(MAX_WORKERS)) worker containers (or raise MAX_WORKERS)" >&2; exit 2; fi
	$(PYTHON) -m app.cluster.compose_env
	WORKERS=$(strip $(WORKERS)) docker compose up -d --scale worker=$(strip $(WORKERS))
	@echo "Grafana http://127.0.0.1:3000, Prometheus http://127.0.0.1:9090; make logs to follow, make down to stop"

down: ## cluster: stop the cluster and remove its containers, network and volumes (checkpoints, metrics) and .cluster.env
	docker compose down -v --remove-orphans
	rm -f $(CLUSTER_ENV_FILE)

grafana-password: ### cluster: print Grafana's admin password (random, made at the cluster's first start; user admin)
	@docker compose exec grafana sh -c 'cat "$${GF_PATHS_DATA:-/var/lib/grafana}/admin-password"; echo'

logs: ### cluster: follow the cluster's logs
	docker compose logs -f

# The long cluster tests, each a pytest marker that only -m selects (tests/conftest.py): not in `make test`.
CHAOS_ARGS ?=        # e.g. CHAOS_ARGS="--parallel zero2" (bench/results/chaos-zero2.json); other flags: a trial in runs/
DRILL ?=             # one drill, e.g. DRILL=store-crash: its row of bench/results/drills.json replaced, the others kept
DRILL_ARGS ?=        # e.g. DRILL_ARGS="--no-alerts": a trial, written to runs/drills.json (tests/e2e/drills/drills.py)
chaos: venv image ## check: the chaos proof: a worker killed and brought back vs an untouched run; PASS/FAIL, JSON + PNG in bench/results/
	CHAOS_ARGS="$(CHAOS_ARGS)" $(PY) -m pytest -m chaos tests/e2e/test_chaos.py -s $(PYTEST_ARGS)

drills: venv image ## check: the failure drills (kill, store crash, full disk, ...; DRILL=name for one): JSON in bench/results/
	DRILL_ARGS="--no-build $(DRILL_ARGS)" $(PY) -m pytest -m drill tests/e2e/test_failure_drills.py -s -v \
	  $(if $(strip $(DRILL)),-k "[$(strip $(DRILL))]") $(PYTEST_ARGS)

# `make memory-demo MEMORY_DEMO_ARGS="--kinds ddp,zero3 --memory 700m"`: the same scenario, other kinds or limit.
MEMORY_DEMO_ARGS ?=
.PHONY: memory-demo
memory-demo: venv image ## check: a user model killed for memory under ddp in 4 containers trains under zero2/3 in the same ones; table, PASS
	$(PY) -m bench.memory_demo $(MEMORY_DEMO_ARGS)

bench-startup: venv image ### bench: each start-up trick on vs off: compose up -> first step (4 workers), then a local world; JSON in bench/results/
	IMAGE_NAME=ddp-cluster $(PY) -m bench.startup
	$(PY) -m bench.local_startup

e2e: venv docker-setup ## check: the end-to-end tests: image, compose up --scale worker=4, Prometheus, every dashboard query
	$(PY) -m pytest -m e2e tests/e2e $(PYTEST_ARGS)

clean: ### dev: remove the virtualenv and caches
	rm -rf $(VENV) .pytest_cache *.egg-info
