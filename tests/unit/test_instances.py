"""Old directories of failed runs are pruned; running instances' and recent ones are kept."""

import os
import time
from pathlib import Path

import pytest

from vsnap import _instances
from vsnap._instances import InstanceRecord, new_instance_dir, register


def test_failed_runs_are_pruned_after_a_while(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_instances, "RUNTIME_DIR", tmp_path / "run")
    control_dir = tmp_path / "control"
    root = Path(f"{control_dir}.instances")
    old_failed, old_running, recent = (root / name for name in ("r-old", "r-running", "r-recent"))
    root.mkdir(mode=0o700)
    for directory in (old_failed, old_running, recent):
        directory.mkdir(mode=0o700)
        (directory / "engine.log").write_text("log")
    long_ago = time.time() - _instances.KEEP_FAILED_S - 60
    for directory in (old_failed, old_running):
        os.utime(directory, (long_ago, long_ago))
    register(InstanceRecord(id="r-running", image="/i", name="n", pid=os.getpid(), url="http://x", port=1,
                            instance_dir=str(old_running), started_at=long_ago))
    instance_id, fresh = new_instance_dir(control_dir, "r")
    assert sorted(p.name for p in root.iterdir()) == sorted(["r-running", "r-recent", instance_id])
    assert fresh.is_dir()
