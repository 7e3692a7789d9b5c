# Fresh machine: `make test` or `make serve` sets everything up itself.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: setup test lint typecheck unit serve demo trace bench bench-full clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

# torch first, pinned: a plain `torch` requirement could pull a multi-GB CUDA build.
# Mooncake needs libibverbs1/librdmacm1 even for TCP: installed when apt is usable (root);
# without them its tests skip with a message.
$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==$(TORCH_VERSION)
	$(BIN)/pip install -q -e '.[dev,net]'
	-@if [ ! -e /usr/lib/x86_64-linux-gnu/libibverbs.so.1 ] && command -v apt-get >/dev/null \
	    && [ "$$(id -u)" = 0 ]; then \
	  apt-get install -y -q --no-install-recommends libibverbs1 librdmacm1 >/dev/null 2>&1 \
	  || (apt-get update -q >/dev/null 2>&1 && \
	      apt-get install -y -q --no-install-recommends libibverbs1 librdmacm1 >/dev/null 2>&1) \
	  || echo "note: libibverbs1 not installed; the Mooncake tests will skip"; fi
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

# The quick benchmark suite (< 10 min on 2 cores): JSON, plots and the README table.
bench: setup
	OMP_WAIT_POLICY=PASSIVE $(BIN)/python benchmarks/run_all.py --budget 600 --readme README.md

bench-full: setup
	OMP_WAIT_POLICY=PASSIVE $(BIN)/python benchmarks/run_all.py --full --readme README.md

trace: setup
	$(BIN)/walkserve trace --model example-cfg-image

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
