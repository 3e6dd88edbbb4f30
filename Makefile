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

.PHONY: help venv demo test bench clean

help: ## list the targets
	@grep -hE '^[a-z][a-z-]*:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-10s %s\n", $$1, $$2}'

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
	$(PY) -m bench.ddp_bench

clean: ## remove the virtualenv and caches
	rm -rf $(VENV) .pytest_cache *.egg-info
