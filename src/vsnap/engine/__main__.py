"""``python -m vsnap.engine CONTROL_DIR``: the root of the engine tree (PID 1 of its namespace).

First thing, the root makes itself a session leader and reopens stdin (/dev/null), stdout and
stderr (the engine log, O_APPEND) so every fd of the tree is opened inside the tree's mount
namespace. As PID 1 it ignores SIGTERM and SIGINT unless it installs handlers, and it must reap
the orphans re-parented to it.
"""

from __future__ import annotations

import asyncio
import atexit
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

from vsnap.protocol import control
from vsnap.protocol.control import ENGINE_LOG


def _reopen_stdio(log_path: Path) -> None:
    null = os.open("/dev/null", os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)


# A zombie child is reaped only after it stayed one this long: a child whose parent thread
# waits for it (subprocess.Popen.wait(), multiprocessing) is reaped by that thread at once, and
# must not be taken from it (its wait() would fail with ECHILD and lose the exit status).
ORPHAN_GRACE_S = 5.0


def reap_orphans_once(seen: dict[int, float], now: float, own: set[int]) -> list[int]:
    """One pass of the PID-1 reaper: reap our zombie children (other than ``own``) that have been
    zombies for ORPHAN_GRACE_S (``seen``: pid -> when first seen as a zombie). Returns those reaped."""
    zombies = set()
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit() or int(entry) in own:
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] == "Z" and int(fields[1]) == os.getpid():
            zombies.add(int(entry))
    for pid in list(seen):
        if pid not in zombies:
            del seen[pid]  # someone else reaped it, or the PID is another process now
    reaped = []
    for pid in sorted(zombies):
        first = seen.setdefault(pid, now)
        if now - first >= ORPHAN_GRACE_S:
            try:
                os.waitpid(pid, os.WNOHANG)
                reaped.append(pid)
            except ChildProcessError:
                pass
            seen.pop(pid, None)
    return reaped


def _block_io_uring_if_asked(control_dir: Path) -> bool:
    """Install the io_uring filter (engine/seccomp.py) first thing, if launch.json asks for it.
    False (after writing error.json) if it cannot be installed."""
    try:
        launch = control.read_message(control_dir, control.LAUNCH, control.LaunchConfig)
        if launch is not None and launch.block_io_uring:
            from .seccomp import block_io_uring  # only for a tree that asks for the filter

            block_io_uring()
            print("vsnap engine: io_uring_setup blocked for the tree (seccomp)", flush=True)
    except (OSError, control.ControlProtocolError) as exc:
        print(f"vsnap engine: cannot start: {exc}", flush=True)
        try:
            control.write_message(control_dir, control.ERROR, control.error_report("launch", exc))
        except OSError:
            pass
        return False
    return True


def _reap_orphans() -> None:
    """Reap zombies of processes re-parented to us (PID 1) that no one else waits for."""
    import multiprocessing  # on the reaper thread: not on the path to the first log line

    seen: dict[int, float] = {}
    while True:
        time.sleep(0.5)
        reap_orphans_once(seen, time.monotonic(), {p.pid for p in multiprocessing.active_children()})


def _watch_owner(control_dir: Path) -> None:
    """Shut the tree down when the vsnap process that owns it is gone (SIGKILLed, crashed), or
    when the `vsnap activate` activating it is (its CUDA state restored, it would hold its GPU
    with no one left to serve it or to end it). Only a heartbeat silent for its timeout counts:
    a look that fails for want of descriptors (clients holding all of them) is retried."""
    watches = (control.HeartbeatWatch(control_dir),
               control.HeartbeatWatch(control_dir, control.ACTIVATOR, control.ACTIVATOR_TIMEOUT_S,
                                      optional=True, role="activates"))
    while True:
        time.sleep(1.0)
        try:
            reason = next((r for r in (w.verdict() for w in watches) if r is not None), None)
        except Exception as exc:  # noqa: BLE001 - the watch must outlive any one look
            print(f"vsnap engine: the owner watch failed one look ({type(exc).__name__}: {exc})", flush=True)
            continue
        if reason is None:
            continue
        print(f"vsnap engine: {reason}; shutting down", flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(10)
        print("vsnap engine: graceful shutdown took too long; exiting", flush=True)
        os._exit(3)


MNT_DETACH = 2
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MAX_SHM_MOUNTS = 16  # binds stacked at a tree's /dev/shm (3 after a restore)


def release_shm() -> None:
    """As the root exits, detach the tree's /dev/shm (the host's /dev/shm/vsnap-ID, bound there at
    launch). The kernel drops the tree's mount namespace a moment after its root is already a
    zombie; a `vsnap ps` that looks in between finds the tree gone but its directory still bound,
    and keeps it (measured: 70 ms after a watchdog shutdown), so it stayed until the next restore
    pruned orphans a minute later. A restored tree has the bind stacked there more than once (the
    launch's, and CRIU's restores of it): each is detached, then an empty read-only tmpfs takes
    their place, so that nothing of the tree still running creates a file in the host's /dev/shm.
    Run at exit, after every other exit handler (a semaphore's unlink); only by the tree's root
    (PID 1); never fatal, and never on the watchdog's forced exit (the tree may still be busy)."""
    if os.getpid() != 1:
        return
    import ctypes  # on the way out only

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        for _ in range(MAX_SHM_MOUNTS):
            if libc.umount2(b"/dev/shm", MNT_DETACH) != 0:
                break  # EINVAL: /dev/shm is no mount point any more
        libc.mount(b"tmpfs", b"/dev/shm", b"tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, b"size=4k")
    except (OSError, AttributeError):
        pass  # the kernel drops the mounts with the namespace anyway


async def _main(control_dir: Path) -> None:
    from .launcher import run_engine  # after stdio is reopened: an import error lands in the engine log

    task = asyncio.current_task()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, task.cancel)  # type: ignore[union-attr]
    await run_engine(control_dir)


def main() -> int:
    if len(sys.argv) != 2:
        print("usage: python -m vsnap.engine CONTROL_DIR", file=sys.stderr)
        return 2
    control_dir = Path(sys.argv[1])
    # Python 3.10 has no PYTHONSAFEPATH: drop the working directory `-m` put first on sys.path
    # (the launcher starts the tree from /, but never import from wherever that is)
    if not getattr(sys.flags, "safe_path", False) and sys.path and sys.path[0] in ("", os.getcwd()):
        del sys.path[0]
    try:
        os.setsid()
    except OSError:
        pass
    _reopen_stdio(control_dir / ENGINE_LOG)
    # registered before anything imports multiprocessing: atexit runs last what came first, so its
    # finalizers (a semaphore's unlink in /dev/shm) run while the tree's /dev/shm is still bound
    atexit.register(release_shm)
    if not _block_io_uring_if_asked(control_dir):
        return 1
    from vsnap.protocol.loopback import loopback_up  # after stdio is reopened (its errors land in the log)

    loopback_up()  # the tree's own network namespace starts with lo down
    print(f"vsnap engine root pid {os.getpid()} starting", flush=True)
    if os.getpid() == 1:
        threading.Thread(target=_reap_orphans, name="reaper", daemon=True).start()
    threading.Thread(target=_watch_owner, args=(control_dir,), name="owner-watch", daemon=True).start()
    try:
        asyncio.run(_main(control_dir))
    except (asyncio.CancelledError, KeyboardInterrupt):
        print("vsnap engine stopped by signal", flush=True)
        return 0
    except BaseException:
        traceback.print_exc()
        return 1
    print("vsnap engine exited", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
