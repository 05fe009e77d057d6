"""The engine side imports only vsnap.protocol and vsnap.engine (docs/architecture.md).

Two checks: every import statement under src/vsnap/engine/ and src/vsnap/protocol/ (the vLLM
adapter too, which cannot be imported without vLLM), and a fresh interpreter that loads the CPU
engine's modules and must not find the orchestrator in sys.modules.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import vsnap

PACKAGE = Path(vsnap.__file__).parent
ALLOWED = ("vsnap.protocol", "vsnap.engine")
ALLOWED_NAMES = ("vsnap", "vsnap.__version__")  # the package itself is lazy: importing it loads nothing
ORCHESTRATOR_ONLY = ("psutil", "yaml", "rich", "typer")


def absolute_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every vsnap import in the file, relative imports resolved."""
    package = ".".join(("vsnap", *path.relative_to(PACKAGE).parent.parts))
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
                names = [f"{module}.{a.name}" if not node.module else module for a in node.names]
                found += [(node.lineno, name) for name in names]
            else:
                found.append((node.lineno, node.module or ""))
    return [(line, m) for line, m in found if m == "vsnap" or m.startswith("vsnap.")]


def test_engine_and_protocol_import_nothing_else_of_vsnap() -> None:
    offenders = []
    for side in ("engine", "protocol"):
        for path in sorted((PACKAGE / side).rglob("*.py")):
            for line, module in absolute_imports(path):
                if module not in ALLOWED_NAMES and not module.startswith(ALLOWED):
                    offenders.append(f"{path.relative_to(PACKAGE)}:{line} imports {module}")
                if side == "protocol" and module.startswith("vsnap.engine"):
                    offenders.append(f"{path.relative_to(PACKAGE)}:{line} imports {module}")
    assert offenders == []


def test_the_checker_sees_a_forbidden_import(tmp_path: Path) -> None:
    """The scan above must be able to fail: a relative import of the orchestrator is found."""
    fake = PACKAGE / "engine" / "_boundary_probe_tmp.py"
    fake.write_text("from .._capture import capture_image\nfrom ..protocol import control\n")
    try:
        assert [m for _, m in absolute_imports(fake)] == ["vsnap._capture", "vsnap.protocol"]
    finally:
        fake.unlink()


ENGINE_MODULES = ["vsnap.engine.__main__", "vsnap.engine.launcher", "vsnap.engine.adapters.base",
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
    assert out.stdout.strip() == "['vsnap']"
    out = subprocess.run([sys.executable, "-c", "import vsnap; print(vsnap.restore_image.__module__)"],
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "vsnap._restore"
