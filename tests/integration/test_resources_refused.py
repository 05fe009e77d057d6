"""A capture that cannot fit is refused before anything boots (ops/resources.py): the image's disk
a 1 MiB tmpfs; `vsnap validate` shows the same shortfall as its `disk` row."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Iterator

import pytest

from tests.conftest import engine_processes
from tests.integration.conftest import run_vsnap, write_spec

pytestmark = pytest.mark.criu


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    mount = tmp_path / "small"
    mount.mkdir(mode=0o700)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=0700", "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_capture_onto_a_full_disk_is_refused_before_the_boot(tmp_path: Path, small_disk: Path) -> None:
    spec = write_spec(tmp_path, "cpu-small")
    result = run_vsnap("capture", str(spec), "--image", str(small_disk / "cpu-small"))
    assert result.returncode == 3, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: not enough disk to capture: 0.1 GB needed"), result.stderr
    assert f"on the disk holding {small_disk}" in errors[0]
    assert engine_processes(tmp_path / "control" / "cpu-small") == []  # nothing was booted
    assert list(small_disk.iterdir()) == []  # nothing was written


def test_validate_shows_the_shortfall_as_its_disk_row(tmp_path: Path, small_disk: Path) -> None:
    spec = write_spec(tmp_path, "cpu-small").read_text().replace(f"{tmp_path}/images", str(small_disk))
    (tmp_path / "small.yaml").write_text(spec)
    result = run_vsnap("validate", str(tmp_path / "small.yaml"), "--json")
    assert result.returncode == 3, result.stdout + result.stderr
    rows = {c["name"]: c for c in json.loads(result.stdout)["checks"]}
    assert not rows["disk"]["ok"] and "not enough disk to capture" in rows["disk"]["detail"]
    assert rows["host memory"]["ok"]
