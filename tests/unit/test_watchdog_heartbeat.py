"""The tree's watchdog (hostile pass 12, issue 26): a flood of clients that uses up the server's
descriptors must not read as a dead owner, and an activator that dies mid-activation must end
the tree within seconds."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from vsnap.protocol import control

REAL_OPEN = os.open


@pytest.fixture
def ctl(tmp_path: Path) -> Path:
    return control.ensure_private_dir(tmp_path / "ctl")


def out_of_descriptors(monkeypatch: pytest.MonkeyPatch, name: str = control.OWNER) -> None:
    """Every open of ``name`` fails as it does when clients hold every descriptor."""
    def failing_open(path: Any, *args: Any, **kwargs: Any) -> int:
        if str(path).endswith(name):
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
        return REAL_OPEN(path, *args, **kwargs)

    monkeypatch.setattr(control.os, "open", failing_open)


def test_owner_gone_reads_emfile_as_no_verdict_and_only_silence_ends_the_tree(
        ctl: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    control.OwnerHeartbeat(ctl).beat()
    out_of_descriptors(monkeypatch)
    with pytest.raises(control.OutOfResources):  # still a ControlProtocolError to every other reader
        control.read_bytes(ctl, control.OWNER)
    assert control.owner_gone(ctl) is None  # was "owner file unusable: ... Too many open files"
    later = time.time() + control.OWNER_TIMEOUT_S + 1
    assert "has been silent for" in (control.owner_gone(ctl, now=later) or "")
    for code in (errno.ENFILE, errno.ENOMEM):
        monkeypatch.setattr(control.os, "open", lambda *a, c=code, **k: (_ for _ in ()).throw(OSError(c, "x")))
        assert control.owner_gone(ctl) is None


def test_a_detached_owner_stays_detached_while_descriptors_are_short(
        ctl: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    control.OwnerHeartbeat(ctl).detach()
    watch = control.HeartbeatWatch(ctl)
    assert watch.verdict() is None  # read once, with its inode
    out_of_descriptors(monkeypatch)
    assert watch.verdict(now=time.time() + 3600) is None  # the same file: still detached
    monkeypatch.undo()
    control.OwnerHeartbeat(ctl).beat()  # a new owner.json (another inode), unreadable from here on
    out_of_descriptors(monkeypatch)
    assert watch.verdict() is None  # written just now: its writer is alive
    assert "silent" in (watch.verdict(now=time.time() + control.OWNER_TIMEOUT_S + 1) or "")


def test_a_file_rewritten_under_the_inode_last_read_is_a_new_beat(ctl: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ext4 may give the next beat the inode of the file its rename replaced: the watch must not
    take the content it read for that of the new file (a stale beat would read as silence)."""
    control.OwnerHeartbeat(ctl).beat()
    watch = control.HeartbeatWatch(ctl)
    assert watch.verdict() is None
    old = os.stat(ctl / control.OWNER).st_mtime
    os.utime(ctl / control.OWNER, (old + 60, old + 60))  # the same inode, written again a minute later
    out_of_descriptors(monkeypatch)
    assert watch.verdict(now=old + 60 + 1) is None


def test_an_unusable_or_missing_owner_file_still_ends_the_tree(ctl: Path) -> None:
    assert control.owner_gone(ctl) == "no owner file"
    (ctl / control.OWNER).write_text("{}")
    os.chmod(ctl / control.OWNER, 0o666)
    assert "owner file unusable" in (control.owner_gone(ctl) or "")


def test_the_activator_watch_ends_a_tree_only_while_an_activation_runs_silent(ctl: Path) -> None:
    watch = control.HeartbeatWatch(ctl, control.ACTIVATOR, control.ACTIVATOR_TIMEOUT_S, optional=True,
                                   role="activates")
    assert watch.verdict(now=time.time() + 3600) is None  # no activation: a standby waits as long as it takes
    beat = control.OwnerHeartbeat(ctl, name=control.ACTIVATOR)
    beat.beat()
    assert watch.verdict() is None
    reason = watch.verdict(now=time.time() + control.ACTIVATOR_TIMEOUT_S + 1)
    assert reason is not None and f"process {os.getpid()} that activates this tree has been silent" in reason
    beat.detach()  # the tree serves: the activation is over
    assert watch.verdict(now=time.time() + 3600) is None
    assert control.OWNER not in os.listdir(ctl)  # the owner's file is another


def test_heartbeats_beat_from_their_thread_without_fsync(ctl: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[int] = []
    monkeypatch.setattr(control.os, "fsync", lambda fd: synced.append(fd))
    with control.OwnerHeartbeat(ctl, name=control.ACTIVATOR):
        time.sleep(control.OWNER_BEAT_S * 2.5)
    assert synced == []
    control.OwnerHeartbeat(ctl, name=control.ACTIVATOR).detach()  # the handover is durable
    assert len(synced) == 2


def test_a_tree_is_launched_with_a_sane_descriptor_limit() -> None:
    """An image keeps the limits its tree was launched with: `ulimit -n 64` must not reach it."""
    script = ("import resource; resource.setrlimit(resource.RLIMIT_NOFILE, (64, 1024));"
              "from vsnap.host.limits import raise_fd_limit; print(*raise_fd_limit(), "
              "*resource.getrlimit(resource.RLIMIT_NOFILE))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    soft, hard, soft_now, hard_now = map(int, out.split())
    assert (soft, hard) == (soft_now, hard_now)
    assert soft == hard and soft in (1024, 65536)  # 65536 where CAP_SYS_RESOURCE allows it
