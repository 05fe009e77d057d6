# vsnap: `make demo` and `make test` set up everything they need (as root, Debian/Ubuntu), every time.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
VSNAP := $(VENV)/bin/vsnap
# The CPU build of torch that this kind of machine keeps on disk; elsewhere pip picks one.
TORCH_WHEEL_DIR ?= /opt/wheels
TORCH ?= $(if $(wildcard $(TORCH_WHEEL_DIR)/torch-2.13.0+cpu-*.whl),torch==2.13.0,torch)
PIP_FLAGS := $(if $(wildcard $(TORCH_WHEEL_DIR)),--find-links $(TORCH_WHEEL_DIR),)

.PHONY: setup system criu venv demo test test-unit clean

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

demo: setup
	VSNAP=$(VSNAP) bash scripts/demo.sh

test: setup
	$(PY) -m pytest tests

test-unit: venv
	$(PY) -m pytest tests/unit

clean:
	rm -rf $(VENV) build *.egg-info
