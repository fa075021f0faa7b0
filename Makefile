# Every target sets itself up: a fresh clone needs only `make demo` or `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CUDA build of torch only where a GPU is present: an unpinned `torch` pulls several GB, the CPU pin is local.
TORCH ?= $(if $(shell command -v nvidia-smi 2>/dev/null),torch,torch==2.13.0)

.PHONY: install test test-slow lint format protos demo clean

$(VENV)/.installed: pyproject.toml Makefile
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || { echo "slipstream needs Python 3.11 or newer as $(PYTHON); pass PYTHON=python3.11"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

install: $(VENV)/.installed

test: install
	$(PY) -m pytest -q -m "not slow"

test-slow: install  # the full demo, synchronous and asynchronous (about 12 minutes on 2 cores)
	$(PY) -m pytest -q -m slow

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: install
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

protos: install
	$(PY) -m slipstream.protogen

demo: install
	$(VENV)/bin/slipstream demo

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
