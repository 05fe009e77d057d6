"""Waits for processes to end go through pidfds (host/proctree): they end at the exit, not at the
next look, and a process named by identity is never confused with a later one under its PID."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from vsnap.host.proctree import ProcessIdentity, identify, kill_tree, wait_gone


def _sleeper(seconds: float) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({seconds})"])


def _reaped(pid: int) -> bool:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return True
    return False


def test_the_wait_ends_when_the_last_process_ends_and_reaps_our_children() -> None:
    short, longer = _sleeper(0.1), _sleeper(0.4)
    started = time.monotonic()
    assert wait_gone([short.pid, longer.pid], 30) == []
    assert time.monotonic() - started < 5  # not the timeout
    assert _reaped(short.pid) and _reaped(longer.pid)


def test_survivors_are_returned_at_the_timeout() -> None:
    running = _sleeper(60)
    try:
        started = time.monotonic()
        assert wait_gone([running.pid], 0.2) == [running.pid]
        assert 0.15 < time.monotonic() - started < 5
        assert wait_gone([running.pid], 0) == [running.pid]  # one look, no wait
    finally:
        running.kill()
        running.wait()


def test_a_zombie_and_a_missing_pid_count_as_gone() -> None:
    zombie = _sleeper(0)
    while identify(zombie.pid) is not None:  # exited, not reaped yet
        time.sleep(0.01)
    assert wait_gone([zombie.pid, zombie.pid], 5) == []
    assert _reaped(zombie.pid)
    assert wait_gone([2**22 + 12345], 5) == []  # past pid_max: no such process


def test_an_identity_whose_pid_is_now_another_process_is_not_waited_for() -> None:
    running = _sleeper(60)
    try:
        identity = identify(running.pid)
        assert identity is not None
        reused = ProcessIdentity(running.pid, identity.start_time - 1, identity.boot_id)  # an earlier process
        started = time.monotonic()
        assert wait_gone([reused], 30) == []
        assert time.monotonic() - started < 5
        assert wait_gone([identity], 0.05) == [running.pid]
    finally:
        running.kill()
        running.wait()


def test_no_limit_waits_for_the_exit() -> None:
    short = _sleeper(0.1)
    identity = identify(short.pid)
    assert identity is not None and wait_gone([identity], None) == []


def test_kill_tree_ends_a_process_that_ignores_sigterm_after_the_grace() -> None:
    stubborn = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, "
                                 "signal.SIG_IGN); print('ready', flush=True); time.sleep(60)"],
                                stdout=subprocess.PIPE)
    assert stubborn.stdout is not None and stubborn.stdout.readline() == b"ready\n"
    started = time.monotonic()
    kill_tree(stubborn.pid, grace_s=0.2)
    assert 0.15 < time.monotonic() - started < 10
    assert _reaped(stubborn.pid) or stubborn.poll() is not None
    stubborn.stdout.close()


def test_a_process_no_pidfd_could_be_had_for_is_reported_while_it_is_alive(monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    def out_of_descriptors(pid: int, flags: int = 0) -> int:
        raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))

    running = _sleeper(60)
    monkeypatch.setattr(os, "pidfd_open", out_of_descriptors)
    try:
        assert wait_gone([running.pid], 0.05) == [running.pid]  # never taken for gone
    finally:
        running.kill()
        running.wait()
    assert wait_gone([running.pid], 0.05) == []


def test_with_no_limit_a_process_no_pidfd_could_be_had_for_is_still_waited_for(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`vsnap restore` in the foreground waits without a limit: out of descriptors, the wait must
    not end at once (the CLI would then take the server for gone and let it end)."""
    import errno
    import threading

    def out_of_descriptors(pid: int, flags: int = 0) -> int:
        raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))

    running = _sleeper(60)
    monkeypatch.setattr(os, "pidfd_open", out_of_descriptors)
    killer = threading.Timer(0.5, running.kill)
    killer.start()
    started = time.monotonic()
    try:
        assert wait_gone([running.pid], None) == []
        assert time.monotonic() - started >= 0.4
    finally:
        killer.cancel()
        running.kill()
        running.wait()
