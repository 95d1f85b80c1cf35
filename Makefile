# Two entry points: `make demo` and `make test`. Both create .venv in the repo root.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# torch 2.13.0 is the CPU build; an unpinned torch may resolve to a multi-GB CUDA build.
TORCH := torch==2.13.0

.PHONY: demo test lint typecheck pytest clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# The C helpers: an editable install builds them, so a new or changed one installs again.
C_HELPERS := $(wildcard src/mltrace/*.c)

$(VENV)/.demo: pyproject.toml setup.py $(C_HELPERS) | $(VENV)/bin/python
	$(PIP) install -q $(TORCH)
	$(PIP) install -q -e .
	@touch $@

$(VENV)/.test: pyproject.toml setup.py $(C_HELPERS) | $(VENV)/bin/python
	$(PIP) install -q $(TORCH)
	$(PIP) install -q -e '.[test]'
	@touch $@ $(VENV)/.demo

demo: $(VENV)/.demo
	@rm -rf mltrace-runs/demo
	$(VENV)/bin/mltrace python --name demo -o mltrace-runs/demo examples/infer.py --iters 3
	$(VENV)/bin/mltrace report mltrace-runs/demo --top 10
	@echo "Trace: $(CURDIR)/mltrace-runs/demo/trace.pftrace (open in https://ui.perfetto.dev or: $(VENV)/bin/mltrace view mltrace-runs/demo)"

lint: $(VENV)/.test
	$(PY) -m ruff check src tests benchmarks examples scripts
	$(PY) -m ruff format --check src tests benchmarks examples scripts

typecheck: $(VENV)/.test
	$(PY) -m mypy

pytest: $(VENV)/.test
	bash scripts/install-chromium.sh
	$(PY) -m pytest -q

test: lint typecheck pytest

clean:
	rm -rf $(VENV) mltrace-runs .mypy_cache .ruff_cache .pytest_cache
