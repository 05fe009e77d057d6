"""A CRIU configuration file on the host must not change what vsnap asks CRIU for.

CRIU reads /etc/criu/default.conf, then ~/.criu/default.conf, then the file CRIU_CONFIG_FILE names,
before its command line. vsnap passes --no-default-config (which skips the first two; CRIU's
config.c gates both on the same flag) and removes CRIU_CONFIG_FILE from CRIU's environment (which
the flag does not cover). The test plants a hostile ~/.criu/default.conf (through HOME) and a
CRIU_CONFIG_FILE, each holding an option CRIU does not know (read, it fails every run), and
runs the real thing: version, check, check --feature, a dump and a restore of a live process.

It does not write /etc/criu/default.conf: other runs of CRIU on this machine, outside this test,
would read it while it exists; the user file exercises the same gate.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from vsnap.host.criu.options import DumpOptions, RestoreOptions
from vsnap.host.criu.runner import CriuRunner

pytestmark = pytest.mark.criu

HOSTILE = "bogus-option-from-a-hostile-config\n"


@pytest.fixture
def hostile_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "home"
    (home / ".criu").mkdir(parents=True)
    (home / ".criu" / "default.conf").write_text(HOSTILE)
    (tmp_path / "env.conf").write_text(HOSTILE)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("CRIU_CONFIG_FILE", str(tmp_path / "env.conf"))
    runner = CriuRunner.locate()
    # the files are hostile indeed: CRIU run without vsnap's precautions fails on them
    plain = subprocess.run([str(runner.binary), "check"], capture_output=True, text=True, timeout=60)
    assert plain.returncode != 0 and "bogus-option" in plain.stderr
    return tmp_path


def test_version_and_checks_ignore_host_config(hostile_config: Path) -> None:
    runner = CriuRunner.locate()
    assert runner.require_version()
    runner.check()
    assert runner.check_feature("uffd-noncoop") in (True, False)  # runs; the answer is the kernel's


def test_dump_and_restore_ignore_host_config(hostile_config: Path) -> None:
    runner = CriuRunner.locate()
    images, work = hostile_config / "images", hostile_config / "work"
    images.mkdir()
    work.mkdir()
    child = subprocess.Popen(["sleep", "600"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
    restored = None
    try:
        runner.dump(DumpOptions(pid=child.pid, images_dir=images, log_file=work / "dump.log"), timeout_s=120)
        assert child.wait(timeout=10) == -signal.SIGKILL  # CRIU ended the dumped process; reaped, its PID is free
        restored = runner.restore(RestoreOptions(images_dir=images, work_dir=work, log_file=work / "restore.log",
                                                 pidfile=work / "restore.pid"), timeout_s=120)
        assert restored == child.pid
        assert Path(f"/proc/{restored}/cmdline").read_bytes().split(b"\0")[:2] == [b"sleep", b"600"]
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        if restored is not None:
            os.kill(restored, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while os.path.exists(f"/proc/{restored}") and time.monotonic() < deadline:
                time.sleep(0.05)
