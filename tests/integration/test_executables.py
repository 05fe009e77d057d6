"""Root runs only what root owns (issue 26, item 4), through the real CLI.

Hostile pass 12: a `criu` owned by another user, first on PATH, was run as root by `vsnap validate`
(its `criu --version` and `criu check`). Now each program vsnap starts is resolved to an absolute
path whose file and directories are root's alone, or refused in one line naming it, and never run.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import VSNAP

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="vsnap runs as root; the fake is chowned away")


def fake(directory: Path, name: str, marker: Path) -> Path:
    """A program that leaves ``marker`` if run, and otherwise passes for a good CRIU or unshare."""
    directory.mkdir(mode=0o755, exist_ok=True)
    program = directory / name
    program.write_text(f"#!/bin/sh\ntouch {marker}\necho 'Version: 4.2.1'\nexit 0\n")
    program.chmod(0o755)
    return program


def validate(path_first: Path | None = None, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {**os.environ, **env}
    if path_first is not None:
        environ["PATH"] = f"{path_first}:{environ['PATH']}"
    return subprocess.run([VSNAP, "validate"], capture_output=True, text=True, timeout=120, env=environ)


def refusal(result: subprocess.CompletedProcess[str], program: Path) -> str:
    lines = [line for line in result.stdout.splitlines() + result.stderr.splitlines() if str(program) in line]
    assert result.returncode != 0, result.stdout + result.stderr
    assert lines, result.stdout + result.stderr
    return lines[0]


@pytest.mark.parametrize("name", ["criu", "unshare", "mount"])
def test_a_program_of_another_user_first_on_path_is_refused_never_run(tmp_path: Path, name: str) -> None:
    marker = tmp_path / "ran-as-root"
    program = fake(tmp_path / "bin", name, marker)
    os.chown(program, 65534, 65534)
    line = refusal(validate(tmp_path / "bin"), program)
    assert "refusing to run" in line and "uid 65534" in line
    assert not marker.exists()


def test_a_group_writable_criu_first_on_path_is_refused_never_run(tmp_path: Path) -> None:
    marker = tmp_path / "ran-as-root"
    program = fake(tmp_path / "bin", "criu", marker)
    program.chmod(0o775)
    line = refusal(validate(tmp_path / "bin"), program)
    assert "0775" in line
    assert not marker.exists()


def test_vsnap_criu_of_another_user_is_refused_never_run(tmp_path: Path) -> None:
    marker = tmp_path / "ran-as-root"
    program = fake(tmp_path / "bin", "criu-custom", marker)
    os.chown(program, 65534, 65534)
    line = refusal(validate(VSNAP_CRIU=str(program)), program)
    assert "VSNAP_CRIU" in line
    assert not marker.exists()
