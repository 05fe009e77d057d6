"""These tests run vsnap's vLLM rules against the real vLLM 0.26.0 parser and config (CPU only).

`make test` runs them in .venv-vllm (vLLM installed without its CUDA dependencies) with
VSNAP_REQUIRE_VLLM=1, where a missing vLLM fails instead of skipping.
"""

import os
from pathlib import Path

import pytest

try:
    import vllm  # noqa: F401
except ImportError:
    if os.environ.get("VSNAP_REQUIRE_VLLM"):
        raise
    pytest.skip("vLLM is not installed in this environment (make test runs these in .venv-vllm)",
                allow_module_level=True)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import subprocess
    import sys

    out = tmp_path_factory.mktemp("models") / "tiny-llama"
    script = Path(__file__).resolve().parents[2] / "scripts" / "make_test_model.py"
    subprocess.run([sys.executable, str(script), str(out)], check=True, capture_output=True)
    return out
