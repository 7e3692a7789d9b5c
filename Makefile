# Fresh machine: `make test` or `make serve` sets everything up itself.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: setup test lint typecheck unit serve demo trace clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

# torch first, pinned: a plain `torch` requirement could pull a multi-GB CUDA build.
$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==$(TORCH_VERSION)
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

setup: $(VENV)/.installed

lint: setup
	$(BIN)/ruff check walkserve tests benchmarks
	$(BIN)/ruff format --check walkserve tests benchmarks

typecheck: setup
	$(BIN)/mypy

unit: setup
	$(BIN)/pytest -q tests/unit

# Worker processes and the test process share 2 cores here: OpenMP threads that spin while
# waiting slow everything down, so they sleep instead.
test: setup lint typecheck
	OMP_WAIT_POLICY=PASSIVE $(BIN)/pytest -q tests

# The HTTP API on 127.0.0.1:8000 (OpenAI-compatible routes), serving walkserve-default.
serve: setup
	$(BIN)/walkserve serve

# Serve every built-in model on worker processes and check each walk against the reference
# interpreter.
demo: setup
	$(BIN)/walkserve demo

trace: setup
	$(BIN)/walkserve trace --model example-cfg-image

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
