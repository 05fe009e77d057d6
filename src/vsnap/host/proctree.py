"""The engine tree as seen from the host: launch it in new PID and mount namespaces, list it, end it.

The tree's root is PID 1 of a fresh PID namespace with its own /proc (`unshare --pid --fork
--mount-proc`): CUDA needs that private /proc, and a restore never collides with host PIDs.
Killing PID 1 of a namespace kills every process in it, so teardown cannot leave orphans.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import stat
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from vsnap.protocol.errors import ProcessTreeError

from .executables import resolve_executable

# psutil (12 ms to import on a loaded 2-core VM) is imported by the functions that use it: a
# restore of a CPU engine never does, and every command's start paid for it.
PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> None:
    """Adopt orphaned descendants (the detached tree CRIU restores) so we can wait for them."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


@dataclass(frozen=True)
class ProcessIdentity:
    """A process, not just a PID: the PID, its start time (clock ticks after boot, field 22 of
    /proc/PID/stat) and the boot it belongs to. A PID that was reused has another start time."""

    pid: int
    start_time: int
    boot_id: str


_boot_ids: list[str] = []  # this boot's id, once read: it cannot change while this process runs


def boot_id() -> str:
    """This boot's id ("" if the kernel does not say), read once (identify runs in every wait loop
    that watches a tree)."""
    if not _boot_ids:
        try:
            _boot_ids.append(BOOT_ID.read_text().strip())
        except OSError:
            return ""
    return _boot_ids[0]


def _stat_fields(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command (state is [0], ppid [1], start time [19])."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def identify(pid: int) -> ProcessIdentity | None:
    """The identity of the live process ``pid`` now, or None if there is none (or a zombie)."""
    fields = _stat_fields(pid)
    if fields is None or fields[0] in ("Z", "X"):
        return None
    return ProcessIdentity(pid, int(fields[19]), boot_id())


def our_children() -> set[int]:
    """This process's children, of every thread (an orphan handed to a subreaper goes to one of them)."""
    children: set[int] = set()
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/children") as f:
                children.update(int(pid) for pid in f.read().split())
        except OSError:
            continue
    return children


def identify_restored_root(pid: int, children_before: set[int]) -> ProcessIdentity | None:
    """The identity of ``pid`` if it is provably the tree CRIU just restored for this process: our
    child (we are the subreaper the detached tree was handed to), not one of ``children_before``
    (our_children() before CRIU ran), and PID 1 of a PID namespace of its own; else None. The PID
    comes from CRIU's pidfile, which the restored tree could rewrite."""
    fields = _stat_fields(pid)
    if fields is None or fields[0] in ("Z", "X") or fields[1] != str(os.getpid()) or pid in children_before:
        return None
    if namespace_pids(pid)[1:] != [1]:  # host PID, then 1 inside the tree's namespace, and no deeper
        return None
    return ProcessIdentity(pid, int(fields[19]), boot_id())  # our child: its PID is ours until we reap it


def namespace_pids(pid: int) -> list[int]:
    """The PIDs of ``pid`` in each PID namespace it is in, outermost first (/proc/PID/status NSpid)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("NSpid:"):
                    return [int(v) for v in line.split()[1:]]
    except (OSError, ValueError):
        pass
    return []


def is_tree_root(identity: ProcessIdentity) -> bool:
    """Is ``identity`` (still) the first process of a PID namespace of its own, one level below
    ours, as every tree vsnap launches or restores is? A record naming any other process names
    no tree of vsnap's: it is never signalled through that record."""
    return namespace_pids(identity.pid)[1:] == [1] and is_same(identity)


def is_vsnap_command(pid: int) -> bool:
    """Does ``pid`` run the vsnap command: ``python -m vsnap``, or vsnap's console script (a file
    named vsnap that imports vsnap.cli, as pip writes it)? What a record names as the owner or
    activator of an instance is signalled only then: a name alone (`less /var/log/vsnap`, `python3
    notes/vsnap`) proves nothing."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = [os.fsdecode(a) for a in f.read().split(b"\0") if a]
    except OSError:
        return False
    if argv and os.path.basename(argv[0]).startswith("python") and any(
            a == "-m" and b in ("vsnap", "vsnap.cli") for a, b in zip(argv[1:3], argv[2:4])):
        return True
    return any(os.path.basename(a) == "vsnap" and _is_console_script(pid, a) for a in argv[:2])


def _is_console_script(pid: int, path: str) -> bool:
    """Is ``path`` (as process ``pid`` named it: relative to its cwd, inside its root) a regular
    file whose first 4 KiB import vsnap.cli (a text search)? Looked at with O_PATH first: only a
    regular file is opened for reading (a device, a FIFO is never opened), and it is read where
    that look found it."""
    where = f"/proc/{pid}/root{path}" if os.path.isabs(path) else f"/proc/{pid}/cwd/{path}"
    try:
        found = os.open(where, os.O_PATH | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        if not stat.S_ISREG(os.fstat(found).st_mode):
            return False
        fd = os.open(f"/proc/self/fd/{found}", os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    finally:
        os.close(found)
    try:
        return b"from vsnap.cli import" in os.read(fd, 4096)
    except OSError:
        return False
    finally:
        os.close(fd)


def in_tree_namespace(pid: int, root: ProcessIdentity) -> bool:
    """Is ``pid`` in the PID namespace whose first process ``root`` is (still the same process)?"""
    try:
        same = os.readlink(f"/proc/{pid}/ns/pid") == os.readlink(f"/proc/{root.pid}/ns/pid")
    except OSError:
        return False
    return same and is_same(root)


def is_same(identity: ProcessIdentity) -> bool:
    """True while the process that ``identity`` names is alive; False once it ended or its PID was reused."""
    return identify(identity.pid) == identity


UTIL_LINUX_HINT = "apt-get install util-linux"


def find_unshare() -> str:
    """unshare's absolute path, root's alone (host.executables), or HostNotReady naming it (or
    naming sh or mount, which it runs: the preflight's "unshare" check covers all three)."""
    find_tree_helpers()
    return str(resolve_executable("unshare", missing_hint=UTIL_LINUX_HINT))


def find_tree_helpers() -> tuple[str, str]:
    """The absolute paths of ``sh`` and ``mount``, which start the tree inside its namespaces: the
    shell would otherwise look ``mount`` up on the PATH of the engine's environment."""
    return (str(resolve_executable("sh", missing_hint="install a POSIX shell (dash)")),
            str(resolve_executable("mount", missing_hint=UTIL_LINUX_HINT)))


@dataclass
class LaunchedTree:
    """The `unshare` process and the namespace's PID 1 (the engine root), by PID and identity."""

    unshare: subprocess.Popen[bytes]
    root_pid: int
    identity: ProcessIdentity


# Inside the new mount namespace (private propagation), bind the instance directory at the
# control path and the instance's shm directory at /dev/shm, then become the engine: PID 1 stays
# the engine after exec. ``$5`` is mount's absolute path (find_tree_helpers).
_BIND_AND_EXEC = '"$5" --bind "$1" "$2" && "$5" --bind "$4" /dev/shm && exec "$3" -m vsnap.engine "$2"'


def launch_tree(control_dir: Path, instance_dir: Path, shm_dir: Path, env: dict[str, str],
                adopt: Callable[[LaunchedTree], None], timeout_s: float = 30) -> LaunchedTree:
    """Start the engine root as PID 1 of new PID, mount and network namespaces, with ``instance_dir`` bound at
    ``control_dir`` and ``shm_dir`` (a directory in the host's /dev/shm) at /dev/shm. ``adopt`` is
    called with the tree before this returns (the caller registers its teardown there): an
    interrupt (Ctrl-C, SIGHUP) that lands before it ran ends the tree here, so there is no moment
    at which the tree belongs to no one."""
    import psutil  # before the tree exists: the first import takes a while

    sh, mount = find_tree_helpers()
    argv = [find_unshare(), "--pid", "--fork", "--mount-proc", "--net", "--propagation", "private",
            sh, "-c", _BIND_AND_EXEC, "vsnap-engine", str(instance_dir), str(control_dir), sys.executable,
            str(shm_dir), mount]
    log_path = instance_dir / "engine.log"
    # 0600 from the start: CRIU checks the log's mode when it reopens it at restore
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        # From / and with PYTHONSAFEPATH: `python -m` would otherwise put the caller's working
        # directory first on sys.path, and a module someone planted there would run as root, in the
        # capture and (frozen into the image) in every restore.
        process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, close_fds=True,
                                   env={**env, "PYTHONSAFEPATH": "1"}, cwd="/", start_new_session=True)
    finally:
        os.close(log)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            try:
                children = psutil.Process(process.pid).children()
            except psutil.NoSuchProcess:
                children = []
            identity = identify(children[0].pid) if children else None
            if identity is not None:
                tree = LaunchedTree(process, identity.pid, identity)
                adopt(tree)
                return tree
            if process.poll() is not None:
                raise ProcessTreeError(process.pid, f"unshare exited with {process.returncode} before the engine "
                                                    "started", phase="launch", log_path=log_path)
            time.sleep(0.01)
        raise ProcessTreeError(process.pid, "the engine root did not appear", phase="launch", log_path=log_path)
    except BaseException:  # a timeout, or Ctrl-C / SIGHUP before the caller holds the tree: end it here
        _abandon_launch(process)
        raise


def _abandon_launch(unshare: subprocess.Popen[bytes]) -> None:
    """End what launch_tree started: the namespace's PID 1 (unshare's own child: its PID cannot be
    reused before unshare reaps it), then unshare. Bounded waits."""
    import psutil

    try:
        for child in psutil.Process(unshare.pid).children():
            kill_tree(child.pid)
    except psutil.NoSuchProcess:
        pass
    if unshare.poll() is None:
        unshare.kill()
    unshare.wait(timeout=30)


def tree_pids(root_pid: int) -> list[int]:
    """The root and all its descendants (host PIDs), root first; empty if the root is gone."""
    import psutil

    try:
        root = psutil.Process(root_pid)
        return [root_pid] + [p.pid for p in root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def seconds_since_start() -> float:
    """How long this process has run (from the kernel's record of its start): what a command spent
    before its first phase (the interpreter's start and the imports)."""
    fields = _stat_fields(os.getpid())
    assert fields is not None  # this process is alive
    started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # since boot, in the clock /proc counts in
    return time.clock_gettime(time.CLOCK_BOOTTIME) - started


def tree_memory_bytes(root_pid: int) -> int:
    """The host memory the tree holds: the sum of its processes' proportional set sizes (shared
    pages counted once across them, /proc/PID/smaps_rollup)."""
    total = 0
    for pid in tree_pids(root_pid):
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        total += int(line.split()[1]) * 1024
                        break
        except OSError:
            continue  # ended meanwhile
    return total


def _pidfd(identity: ProcessIdentity) -> int | None:
    """A pidfd for exactly that process (opened, then the identity checked again), or None."""
    try:
        fd = os.pidfd_open(identity.pid)
    except (ProcessLookupError, OSError):
        return None
    if not is_same(identity):  # the PID was reused between our check and the open
        os.close(fd)
        return None
    return fd


def _wait_pidfds(fds: dict[int, int], timeout_s: float | None) -> list[int]:
    """Wait until the processes behind these pidfds (pid -> fd) exited, reaping those that are our
    children; return the PIDs still running after ``timeout_s`` (None: no limit). One poll(2) on
    every pidfd: the kernel wakes it at each exit, so the wait ends when the last one ends (no
    sleep between looks), and a pidfd names one process, never a later one with its PID."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    left = dict(fds)
    pid_of = {fd: pid for pid, fd in fds.items()}
    poller = select.poll()
    for fd in left.values():
        poller.register(fd, select.POLLIN)
    while left:
        remaining = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        for fd, _ in poller.poll(None if remaining is None else remaining * 1000):  # ms, rounded up
            poller.unregister(fd)
            reap(pid_of[fd])
            del left[pid_of[fd]]
        if remaining == 0:
            break  # the last look, at the deadline
    return sorted(left)


def alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def _watch(process: int | ProcessIdentity) -> int | None:
    """A pidfd for the process: one given by identity only while it is still that process (a
    zombie no longer is), one given by PID whatever runs under it now (a zombie too: its pidfd
    reads as exited at once). None once there is none, and a zombie child of ours under that PID
    is reaped (our children's PIDs are not reused before we reap them). OSError (out of
    descriptors) when the kernel gives no pidfd."""
    pid = process.pid if isinstance(process, ProcessIdentity) else process
    try:
        fd: int | None = os.pidfd_open(pid)
    except ProcessLookupError:
        fd = None
    if fd is not None and isinstance(process, ProcessIdentity) and not is_same(process):
        os.close(fd)  # it ended (a zombie), or its PID is another process's now
        fd = None
    if fd is None:
        reap(pid)
    return fd


def wait_gone(processes: Sequence[int | ProcessIdentity], timeout_s: float | None) -> list[int]:
    """Wait until none of ``processes`` is alive (reaping our own children); return the PIDs still
    alive after ``timeout_s`` (None: no limit). Each is watched through a pidfd taken at the start
    (_watch, _wait_pidfds): the wait ends at the last exit, and a watched process's PID reused
    after it is never mistaken for it. A PID given as a number is taken as whatever runs under it
    when the wait starts (give an identity where it may already be reused: our children's PIDs
    cannot be before we reap them). A process no pidfd could be had for (out of descriptors) is
    watched by polling instead, and reported if it is alive at the end (with no limit, waited
    for: a pidfd that could not be had must not end the wait at once)."""
    fds: dict[int, int] = {}
    unwatched: list[int] = []
    try:
        for process in processes:
            pid = process.pid if isinstance(process, ProcessIdentity) else process
            if pid in fds:
                continue
            try:
                fd = _watch(process)
            except OSError:
                unwatched.append(pid)
                continue
            if fd is not None:
                fds[pid] = fd
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        survivors = _wait_pidfds(fds, timeout_s)
    finally:
        for fd in fds.values():
            os.close(fd)
    while unwatched and (deadline is None or time.monotonic() < deadline):  # no pidfd: looked at
        unwatched = [pid for pid in unwatched if alive(pid)]
        if unwatched:
            time.sleep(0.2)
    return sorted(survivors + [pid for pid in unwatched if alive(pid)])


def kill_tree(root: int | ProcessIdentity, *, grace_s: float = 0.0) -> None:
    """End the whole namespace: SIGTERM and a grace period if asked, then SIGKILL to its PID 1.

    Signals go through pidfds of the processes as identified (``root`` may be a PID of our own
    child, which cannot be reused before we reap it, or a recorded identity): a process whose
    PID was reused is never signalled. Waits are bounded.
    """
    identity = root if isinstance(root, ProcessIdentity) else identify(root)
    pid = identity.pid if identity is not None else int(root)  # type: ignore[arg-type]
    root_fd = _pidfd(identity) if identity is not None else None
    if root_fd is None:
        reap(pid)
        return
    fds = {pid: root_fd}
    try:
        if grace_s > 0:
            try:
                signal.pidfd_send_signal(root_fd, signal.SIGTERM)
            except ProcessLookupError:
                pass
            if not _wait_pidfds(fds, grace_s):
                return
        # descendants, each pinned by a pidfd while their root still holds them
        for child in tree_pids(pid)[1:]:
            child_identity = identify(child)
            fd = _pidfd(child_identity) if child_identity is not None else None
            if fd is not None:
                fds[child] = fd
        for fd in fds.values():
            try:
                signal.pidfd_send_signal(fd, signal.SIGKILL)
            except ProcessLookupError:
                pass
        survivors = _wait_pidfds(fds, 10)
        if survivors:
            raise ProcessTreeError(survivors[0], f"processes {survivors} survived SIGKILL", phase="teardown")
    finally:
        for fd in fds.values():
            os.close(fd)


def open_fds(pid: int) -> dict[str, str]:
    """A process's open fds, /proc/PID/fd/N -> what it points at (readlink); none for a process
    that is gone or whose fds cannot be read, and an fd closed while listed is skipped."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return {}
    targets = {}
    for fd in fds:
        try:
            targets[f"/proc/{pid}/fd/{fd}"] = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
    return targets


def fd_targets(pid: int) -> set[str]:
    """What a process's open fds point at (open_fds)."""
    return set(open_fds(pid).values())


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
        files.update(target for target in fd_targets(pid) if target.startswith("/"))
    return {f for f in files if not f.endswith(" (deleted)") and os.path.isfile(f)
            and not f.startswith(("/dev/", "/proc/", "/sys/"))}


GPU_DEVICE_PREFIX = "/dev/nvidia"


def gpu_device_majors(devices: str = "/proc/devices") -> set[int]:
    """The character-device majors of NVIDIA's drivers on this host (195 and the dynamic ones:
    nvidia-uvm, nvidia-caps, nvidia-nvlink, ...), from /proc/devices."""
    majors = {195}
    try:
        lines = Path(devices).read_text().splitlines()
    except OSError:
        return majors
    for line in lines:
        number, _, name = line.strip().partition(" ")
        if number.isdigit() and name.strip().startswith("nvidia"):
            majors.add(int(number))
    return majors


def open_device_files(pids: list[int], prefix: str = GPU_DEVICE_PREFIX, majors: set[int] | None = None,
                      ) -> dict[int, list[str]]:
    """The GPU device files each process has open, for the processes that have any: fd targets
    under ``prefix``, and character devices of the GPU's majors wherever their node lives (a node
    made with mknod elsewhere, /dev/char/195:0 is a link and resolves to /dev/nvidia0 anyway). A
    process that is gone, or whose fds cannot be read, counts as having none."""
    majors = gpu_device_majors() if majors is None else majors
    found: dict[int, list[str]] = {}
    for pid in pids:
        held = set()
        for fd, target in open_fds(pid).items():
            if target.startswith(prefix):
                held.add(target)
                continue
            if not target.startswith("/"):  # socket:[N], pipe:[N], anon_inode:...: no device node
                continue
            try:
                st = os.stat(fd)  # the open file itself, not a path to it
            except OSError:
                continue
            if stat.S_ISCHR(st.st_mode) and os.major(st.st_rdev) in majors:
                held.add(target)
        if held:
            found[pid] = sorted(held)
    return found
