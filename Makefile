# Two entry points for a fresh machine: `make demo` and `make test`.
# Both create .venv (once; again when pyproject.toml changes) and install what they need.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# This machine keeps torch 2.13.0's CPU build locally; override elsewhere, e.g.
# `make test TORCH=torch` to take the newest release.
TORCH  ?= torch==2.13.0

STAMP := $(VENV)/.installed

.PHONY: demo test lint check bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/asyncrefit demo

test: $(STAMP)
	$(BIN)/python -m pytest

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/ruff format --check src tests benchmarks examples
	$(BIN)/mypy

check: lint test

bench: $(STAMP)
	$(BIN)/asyncrefit bench

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis
