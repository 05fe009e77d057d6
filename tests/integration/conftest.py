from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest

from tests.conftest import VSNAP, engine_processes
from vsnap import Manifest, read_manifest


@dataclass(frozen=True)
class CapturedImage:
    spec: Path
    image: Path
    control_dir: Path
    manifest: Manifest
    capture_json: dict


def write_spec(directory: Path, name: str, **extra: str) -> Path:
    lines = [f"name: {name}", "engine: cpu", f"image: {directory}/images/{name}",
             "snapshot:", f"  control_dir: {directory}/control/{name}", "  timeout_s: 120"]
    lines += [f"{k}: {v}" for k, v in extra.items()]
    spec = directory / f"{name}.yaml"
    spec.write_text("\n".join(lines) + "\n")
    return spec


def run_vsnap(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([VSNAP, *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="session")
def captured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CapturedImage]:
    """One real capture of the CPU engine through the CLI, shared by the tests that only read it."""
    base = tmp_path_factory.mktemp("vsnap")
    spec = write_spec(base, "cpu-it")
    result = run_vsnap("capture", str(spec), "--json")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    image = Path(doc["image"])
    control_dir = base / "control" / "cpu-it"
    yield CapturedImage(spec, image, control_dir, read_manifest(image), doc)
    for pid in engine_processes(control_dir):
        subprocess.run(["kill", "-9", str(pid)])
