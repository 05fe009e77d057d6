"""The engine root's orphan reaper (it is PID 1 of its namespace) must not take a child that
its own code waits for: that wait() would fail and lose the child's exit status."""

from __future__ import annotations

import subprocess
import sys
import time

from vsnap.engine.__main__ import ORPHAN_GRACE_S, reap_orphans_once


def exited(code: int) -> subprocess.Popen[bytes]:
    child = subprocess.Popen([sys.executable, "-c", f"raise SystemExit({code})"])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # until it is a zombie, not yet waited for
        with open(f"/proc/{child.pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                return child
        time.sleep(0.01)
    raise AssertionError("the child did not exit")


def test_a_fresh_zombie_is_left_to_the_code_that_waits_for_it() -> None:
    child = exited(7)
    seen: dict[int, float] = {}
    assert child.pid not in reap_orphans_once(seen, time.monotonic(), set())
    assert child.wait(timeout=5) == 7  # its status is still there


def test_a_zombie_no_one_waits_for_is_reaped_after_the_grace() -> None:
    child = exited(3)
    seen: dict[int, float] = {}
    now = time.monotonic()
    assert child.pid not in reap_orphans_once(seen, now, set())
    assert child.pid in reap_orphans_once(seen, now + ORPHAN_GRACE_S, set())
    child.returncode = 3  # reaped by the reaper: keep Popen from waiting again
