# vsnap: `make demo` and `make test` set up everything they need (as root, Debian/Ubuntu), every time.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
# vLLM 0.26.0 without its CUDA dependencies: CI checks the snapshot rules against its real parser
VENV_VLLM ?= .venv-vllm
PY := $(VENV)/bin/python
VSNAP := $(VENV)/bin/vsnap
# The CPU build of torch that this kind of machine keeps on disk; elsewhere pip picks one.
TORCH_WHEEL_DIR ?= /opt/wheels
TORCH ?= $(if $(wildcard $(TORCH_WHEEL_DIR)/torch-2.13.0+cpu-*.whl),torch==2.13.0,torch)
PIP_FLAGS := $(if $(wildcard $(TORCH_WHEEL_DIR)),--find-links $(TORCH_WHEEL_DIR),)

.PHONY: setup system criu venv vllm-venv demo test test-unit test-vllm clean

setup: system criu venv

system:
	@command -v apt-get >/dev/null || { echo "make setup needs apt-get (Debian/Ubuntu)"; exit 1; }
	@if ! dpkg -s python3-venv util-linux curl iproute2 >/dev/null 2>&1; then \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	    python3 python3-venv python3-pip util-linux curl iproute2 ca-certificates >/dev/null; fi

criu:
	bash scripts/criu/install.sh

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(PIP_FLAGS) "$(TORCH)"
	$(PY) -m pip install -q $(PIP_FLAGS) -e ".[cpu,dev]"
	touch $@

venv: $(VENV)/.installed

$(VENV_VLLM)/.installed: pyproject.toml requirements/vllm-rules.txt
	$(PYTHON) -m venv $(VENV_VLLM)
	$(VENV_VLLM)/bin/python -m pip install -q $(PIP_FLAGS) "$(TORCH)"
	$(VENV_VLLM)/bin/python -m pip install -q $(PIP_FLAGS) -r requirements/vllm-rules.txt
	$(VENV_VLLM)/bin/python -m pip install -q --no-deps vllm==0.26.0
	$(VENV_VLLM)/bin/python -m pip install -q --no-deps -e .
	touch $@

vllm-venv: $(VENV_VLLM)/.installed

demo: setup
	VSNAP=$(VSNAP) bash scripts/demo.sh

test: setup vllm-venv
	$(PY) -m pytest tests
	$(MAKE) test-vllm

test-vllm: vllm-venv
	VSNAP_REQUIRE_VLLM=1 $(VENV_VLLM)/bin/python -m pytest tests/vllm -p no:cacheprovider

test-unit: venv
	$(PY) -m pytest tests/unit

clean:
	rm -rf $(VENV) $(VENV_VLLM) build *.egg-info
