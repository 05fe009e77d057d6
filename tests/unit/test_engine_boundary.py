"""The rooms' layers and the engine boundary (docs/architecture.md).

Two checks: import-linter's contracts over every import statement of the package (the vLLM adapter
too, which cannot be imported without vLLM), and a fresh interpreter that loads the CPU engine's
modules and must not find the orchestrator in sys.modules.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import vsnap

PACKAGE = Path(vsnap.__file__).parent
REPO = PACKAGE.parent.parent
ALLOWED = ("vsnap.protocol", "vsnap.engine")
ORCHESTRATOR_ONLY = ("psutil", "yaml", "rich", "typer")


def lint_imports(*args: str) -> subprocess.CompletedProcess[str]:
    """import-linter's contracts (pyproject.toml, [tool.importlinter]) over the installed source."""
    linter = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    if linter is None:
        pytest.skip("import-linter is not installed here: pip install -e '.[dev]'")
    return subprocess.run([linter, "--no-cache", *args], cwd=REPO, capture_output=True, text=True)


def test_the_rooms_and_the_engine_boundary_hold() -> None:
    """Each room imports only the rooms below it; the engine and the protocol import no other room
    and none of the orchestrator's packages; no adapter imports another."""
    result = lint_imports()
    assert result.returncode == 0, result.stdout[-4000:]
    assert result.stdout.count(" KEPT") == 4


def test_the_contracts_can_fail() -> None:
    """An engine module that imports a use case breaks two contracts, and the linter says which."""
    fake = PACKAGE / "engine" / "_boundary_probe_tmp.py"
    fake.write_text("from ..ops.capture import capture_image\n")
    try:
        result = lint_imports()
    finally:
        fake.unlink()
    assert result.returncode == 1
    assert "vsnap.engine._boundary_probe_tmp -> vsnap.ops.capture" in result.stdout
    assert "rooms: each imports only the rooms below it BROKEN" in result.stdout
    assert "the engine tree imports only the protocol it shares with the CLI BROKEN" in result.stdout


ENGINE_MODULES = ["vsnap.engine.__main__", "vsnap.engine.launcher", "vsnap.engine.adapters",
                  "vsnap.engine.adapters.base",
                  "vsnap.engine.adapters.cpu", "vsnap.engine.adapters.cpu.adapter", "vsnap.engine.adapters.cpu.model",
                  "vsnap.engine.adapters.cpu.scheduler", "vsnap.engine.adapters.cpu.server",
                  "vsnap.engine.adapters.cpu.worker", "vsnap.engine.seccomp"]


def test_a_fresh_engine_interpreter_loads_no_orchestrator() -> None:
    code = ("import importlib, json, sys\n"
            f"for m in {ENGINE_MODULES!r}: importlib.import_module(m)\n"
            "print(json.dumps(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = json.loads(out.stdout)
    ours = [m for m in loaded if m.startswith("vsnap")]
    assert "vsnap.engine.adapters.cpu.adapter" in ours  # the probe really ran
    assert [m for m in ours if m != "vsnap" and not m.startswith(ALLOWED)] == []
    assert [m for m in ORCHESTRATOR_ONLY if m in loaded] == []


def test_import_vsnap_is_lazy() -> None:
    out = subprocess.run([sys.executable, "-c", "import sys, vsnap; print(sorted(m for m in sys.modules "
                          "if m.startswith('vsnap')))"], capture_output=True, text=True, check=True)
    # the package face and the version leaf it reads __version__ from, nothing else
    assert out.stdout.strip() == "['vsnap', 'vsnap.protocol', 'vsnap.protocol.version']"
    out = subprocess.run([sys.executable, "-c", "import vsnap; print(vsnap.restore_image.__module__)"],
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "vsnap.ops.restore"
