"""VSNAP_RUNTIME_DIR decides where vsnap's records are, and the records decide what it stops and
removes: a value that is not a clean absolute directory of its own is refused in one line
(hostile pass 10: an empty value meant the working directory)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from vsnap.host.paths import DEFAULT_RUNTIME_DIR, _runtime_dir

VSNAP = str(Path(sys.executable).with_name("vsnap"))


@pytest.mark.parametrize("value, why", [
    ("", "must be an absolute path"), ("run/vsnap", "must be an absolute path"),
    ("/tmp/a/../b", "must not contain '..'"), ("/tmp/rt\n", "control characters"),
    ("/etc", "system directory"), ("/usr/lib/vsnap", "inside /usr"), ("/", "system directory"),
])
def test_a_runtime_dir_that_is_not_a_directory_of_its_own_is_refused(value: str, why: str) -> None:
    directory, problem = _runtime_dir(value)
    assert directory == DEFAULT_RUNTIME_DIR and problem is not None and why in problem


def test_the_default_and_a_clean_directory_are_taken() -> None:
    assert _runtime_dir(None) == (DEFAULT_RUNTIME_DIR, None)
    assert _runtime_dir("/run/vsnap") == _runtime_dir("/run/vsnap/") == _runtime_dir("//run//vsnap/.") == \
        (DEFAULT_RUNTIME_DIR, None)
    assert _runtime_dir("/tmp/rt//x/") == _runtime_dir("//tmp/rt/x") == (Path("/tmp/rt/x"), None)


def test_every_command_refuses_it_in_one_line(tmp_path: Path) -> None:
    out = subprocess.run([VSNAP, "ps"], capture_output=True, text=True, timeout=60, cwd=tmp_path,
                         env={**os.environ, "VSNAP_RUNTIME_DIR": ""})
    assert out.returncode == 3, out.stderr
    assert "VSNAP_RUNTIME_DIR must be an absolute path" in out.stderr
    assert "set VSNAP_RUNTIME_DIR to an absolute directory of its own" in out.stderr
    assert not (tmp_path / "instances").exists()
