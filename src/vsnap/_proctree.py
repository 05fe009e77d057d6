"""The engine tree as seen from the host: launch it in new PID and mount namespaces, list it, end it.

The tree's root is PID 1 of a fresh PID namespace with its own /proc (`unshare --pid --fork
--mount-proc`): CUDA needs that private /proc, and a restore never collides with host PIDs.
Killing PID 1 of a namespace kills every process in it, so teardown cannot leave orphans.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from .protocol.errors import HostNotReady, ProcessTreeError

PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> None:
    """Adopt orphaned descendants (the detached tree CRIU restores) so we can wait for them."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def find_unshare() -> str:
    path = shutil.which("unshare")
    if not path:
        raise HostNotReady("unshare", "unshare (util-linux) is not installed", hint="apt-get install util-linux")
    return path


@dataclass
class LaunchedTree:
    """The `unshare` process and the host PID of the namespace's PID 1 (the engine root)."""

    unshare: subprocess.Popen[bytes]
    root_pid: int


# Inside the new mount namespace (private propagation), bind the instance directory at the
# control path and the instance's shm directory at /dev/shm, then become the engine: PID 1 stays
# the engine after exec.
_BIND_AND_EXEC = 'mount --bind "$1" "$2" && mount --bind "$4" /dev/shm && exec "$3" -m vsnap.engine "$2"'


def launch_tree(control_dir: Path, instance_dir: Path, shm_dir: Path, env: dict[str, str],
                timeout_s: float = 30) -> LaunchedTree:
    """Start the engine root as PID 1 of new PID, mount and network namespaces, with ``instance_dir`` bound at
    ``control_dir`` and ``shm_dir`` (a directory in the host's /dev/shm) at /dev/shm."""
    argv = [find_unshare(), "--pid", "--fork", "--mount-proc", "--net", "--propagation", "private",
            "sh", "-c", _BIND_AND_EXEC, "vsnap-engine", str(instance_dir), str(control_dir), sys.executable,
            str(shm_dir)]
    log_path = instance_dir / "engine.log"
    # 0600 from the start: CRIU checks the log's mode when it reopens it at restore
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, close_fds=True, env=env,
                                   start_new_session=True)
    finally:
        os.close(log)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            children = psutil.Process(process.pid).children()
        except psutil.NoSuchProcess:
            children = []
        if children:
            return LaunchedTree(process, children[0].pid)
        if process.poll() is not None:
            raise ProcessTreeError(process.pid, f"unshare exited with {process.returncode} before the engine started",
                                   phase="launch", log_path=log_path)
        time.sleep(0.01)
    process.kill()
    raise ProcessTreeError(process.pid, "the engine root did not appear", phase="launch", log_path=log_path)


def tree_pids(root_pid: int) -> list[int]:
    """The root and all its descendants (host PIDs), root first; empty if the root is gone."""
    try:
        root = psutil.Process(root_pid)
        return [root_pid] + [p.pid for p in root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    """Wait until none of ``pids`` is alive (reaping our own children); return the survivors."""
    deadline = time.monotonic() + timeout_s
    while True:
        for pid in pids:
            reap(pid)
        left = [pid for pid in pids if alive(pid)]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.02)


def kill_tree(root_pid: int, *, grace_s: float = 0.0) -> None:
    """End the whole namespace: SIGTERM and a grace period if asked, then SIGKILL to its PID 1."""
    pids = tree_pids(root_pid)
    if not pids:
        reap(root_pid)
        return
    if grace_s > 0:
        try:
            os.kill(root_pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        pids = wait_gone(pids, grace_s)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    survivors = wait_gone(pids, 10)
    if survivors:
        raise ProcessTreeError(survivors[0], f"processes {survivors} survived SIGKILL", phase="teardown")


def mapped_and_open_files(pids: list[int]) -> set[str]:
    """Regular files the tree has mapped or open: what a restore needs to find unchanged."""
    files: set[str] = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as maps:
                for line in maps:
                    parts = line.split(maxsplit=5)
                    if len(parts) == 6 and parts[5].startswith("/"):
                        files.add(parts[5].strip())
        except OSError:
            continue
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                if target.startswith("/"):
                    files.add(target)
        except OSError:
            continue
    return {f for f in files if not f.endswith(" (deleted)") and os.path.isfile(f)
            and not f.startswith(("/dev/", "/proc/", "/sys/"))}
