"""A process tree with every kind of task CRIU restores, through the CRIU that scripts/criu/
builds, with our patches scripts/criu/patches/: 0001, the root task restores its memory beside
the other tasks, waiting only until they have restored their files (its new counter must count
every kind of task once, or a restore hangs or fails); 0002, each task's pages are read on
several threads with TIDs no task of the image has (every byte must land where it was).

Real CRIU, real processes: a tree of a root (a child subreaper), a child, a zombie and an orphan
whose session leader is gone (CRIU restores that leader as a helper task), each holding a dense
and a sparse anonymous mapping of random bytes, and all sharing one the root wrote before it
forked (CRIU restores that one through the root's premapped area, copy-on-write). The tree is
dumped and restored twice; each time every process checks its own memory against the digests
it took before the dump, the zombie is there, and the mappings are where they were. A restore
that hangs fails at the runner's timeout.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vsnap.host.criu.options import DumpOptions, RestoreOptions
from vsnap.host.criu.runner import CriuRunner

pytestmark = pytest.mark.criu

DENSE_MIB, SPARSE_MIB = 64, 64

# Each process: a dense mapping (every page written) and a sparse one (every third page), digests
# of both in STATUS/<pid>.json; on SIGUSR1 it digests them again into STATUS/<pid>.check.json.
TREE = r"""
import ctypes, hashlib, json, mmap, os, signal, sys, time
status = sys.argv[1]
DENSE, SPARSE = int(sys.argv[2]) << 20, int(sys.argv[3]) << 20
PAGE = mmap.PAGESIZE

libc = ctypes.CDLL(None, use_errno=True)
libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)

def mapping(size):
    # size bytes between two PROT_NONE pages: a VMA of its own, never merged with a neighbour
    m = mmap.mmap(-1, size + 2 * PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    at = ctypes.addressof(ctypes.c_char.from_buffer(m))
    for guard in (at, at + PAGE + size):
        assert libc.mprotect(guard, PAGE, 0) == 0  # PROT_NONE
    return memoryview(m)[PAGE:PAGE + size], at + PAGE

def hold(role, pad_mib):
    # a different address in each process: CRIU takes a VMA at the same place in a parent and its
    # child for one inherited through fork, and restores those otherwise (premapped, in criu)
    pad = mmap.mmap(-1, pad_mib << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    dense, dense_at = mapping(DENSE)
    dense[:] = os.urandom(DENSE)
    sparse, sparse_at = mapping(SPARSE)
    for off in range(0, SPARSE, 3 * PAGE):
        sparse[off:off + PAGE] = os.urandom(PAGE)
    def digests():
        return {"dense": hashlib.sha256(dense).hexdigest(), "sparse": hashlib.sha256(sparse).hexdigest(),
                "inherited": hashlib.sha256(inherited).hexdigest()}
    def check(signum, frame):
        path = f"{status}/{os.getpid()}.check.json"
        with open(path + ".tmp", "w") as f:
            json.dump(digests(), f)
        os.rename(path + ".tmp", path)
    signal.signal(signal.SIGUSR1, check)
    record = {"role": role, "pid": os.getpid(), "dense_at": dense_at, "sparse_at": sparse_at, **digests()}
    with open(f"{status}/{os.getpid()}.json.tmp", "w") as f:
        json.dump(record, f)
    os.rename(f"{status}/{os.getpid()}.json.tmp", f"{status}/{os.getpid()}.json")
    while True:
        signal.pause()

PR_SET_CHILD_SUBREAPER = 36
libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
inherited, _ = mapping(8 << 20)         # written before the forks: every process shares its pages
inherited[:] = os.urandom(8 << 20)
if os.fork() == 0:
    hold("child", 2)
if os.fork() == 0:
    os._exit(0)                         # never reaped: a zombie in the dump
leader = os.fork()
if leader == 0:
    os.setsid()
    if os.fork() == 0:
        hold("orphan", 4)               # its session leader exits: CRIU needs a helper for it
    os._exit(0)
os.waitpid(leader, 0)
hold("root", 6)
"""


def smaps(pid: int) -> dict[int, dict[str, str]]:
    """Start address -> the smaps fields of that mapping."""
    out: dict[int, dict[str, str]] = {}
    current: dict[str, str] = {}
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            current = {"range": head, "perms": line.split()[1]}
            out[int(head.split("-")[0], 16)] = current
        elif head.endswith(":"):
            current[head[:-1]] = line[len(head):].strip()
    return out


def patched_build(runner: CriuRunner) -> bool:
    """The CRIU scripts/criu/install.sh built with our patches (it stamps them beside it)."""
    return (runner.binary.resolve().parent.parent / "lib" / "criu" / "vsnap-patches").is_file()


def kilobytes(field: str) -> int:
    return int(field.split()[0])


def wait_for(predicate, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def gone(pids) -> bool:
    """Every pid free again. Killed tasks are reparented to the nearest subreaper, which may be
    this process (vsnap's own code, run earlier in the suite, makes it one): reap those here."""
    for pid in pids:
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
    return not any(os.path.exists(f"/proc/{pid}") for pid in pids)


def kill_restored(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    wait_for(lambda: gone(pids), "the restored tree to go")


def test_a_tree_of_every_kind_of_task_comes_back_whole(tmp_path: Path) -> None:
    runner = CriuRunner.locate()
    status, images, work = tmp_path / "status", tmp_path / "images", tmp_path / "work"
    for d in (status, images, work):
        d.mkdir()
    root = subprocess.Popen([sys.executable, "-c", TREE, str(status), str(DENSE_MIB), str(SPARSE_MIB)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, cwd="/")
    restored: list[int] = []
    try:
        wait_for(lambda: len(list(status.glob("*.json"))) == 3, "the tree to write its digests")
        records = {r["pid"]: r for r in (json.loads(p.read_text()) for p in status.glob("*.json"))}
        assert {r["role"] for r in records.values()} == {"root", "child", "orphan"}
        before = {pid: smaps(pid) for pid in records}
        task_threads = {pid: sorted(os.listdir(f"/proc/{pid}/task")) for pid in records}
        tree = [root.pid, *_children(root.pid)]  # the zombie too: its pid must be free for the restore
        assert "Z" in [Path(f"/proc/{p}/stat").read_text().split()[2] for p in tree[1:]]

        runner.dump(DumpOptions(pid=root.pid, images_dir=images, log_file=work / "dump.log"), timeout_s=120)
        assert root.wait(timeout=10) == -signal.SIGKILL
        wait_for(lambda: gone(tree), "the dumped tree to go")

        allowed = os.sched_getaffinity(0)
        for n in (1, 2, 3):
            log = work / f"restore-{n}.log"
            if n == 3:  # on one CPU this process may use (taskset, a cpuset): patch 0002 starts no reader
                os.sched_setaffinity(0, {min(allowed)})
            try:
                top = runner.restore(RestoreOptions(images_dir=images, work_dir=work, log_file=log,
                                                    pidfile=work / f"restore-{n}.pid"), timeout_s=120)
            finally:
                os.sched_setaffinity(0, allowed)
            restored = tree
            assert top == root.pid and all(os.path.exists(f"/proc/{pid}") for pid in records)
            assert "Z" in [Path(f"/proc/{p}/stat").read_text().split()[2] for p in _children(top)]
            # the task's own threads and nothing else: patch 0002's readers are gone
            assert {pid: sorted(os.listdir(f"/proc/{pid}/task")) for pid in records} == task_threads
            for pid, record in records.items():  # before the checks below allocate
                now = smaps(pid)
                for name in ("dense_at", "sparse_at"):
                    was, back = before[pid][record[name]], now[record[name]]
                    assert (back["range"], back["perms"], kilobytes(back["Rss"])) == \
                           (was["range"], was["perms"], kilobytes(was["Rss"])), (record["role"], name)
            for pid in records:
                (status / f"{pid}.check.json").unlink(missing_ok=True)
                os.kill(pid, signal.SIGUSR1)
            wait_for(lambda: all((status / f"{pid}.check.json").exists() for pid in records), "the digests")
            for pid, record in records.items():
                check = json.loads((status / f"{pid}.check.json").read_text())
                assert check == {k: record[k] for k in ("dense", "sparse", "inherited")}, (record["role"], n)
            text = log.read_text(errors="replace")
            reads = re.findall(r"pie: (\d+): vsnap: \d+ MiB of pages read on (\d+) threads", text)
            if patched_build(runner) and n == 3:
                assert reads == [], reads  # the readers count the CPUs of the affinity, not those online
            elif patched_build(runner) and len(allowed) > 1:
                # patch 0002: each task's ~90 MiB of pages read on its readers and its own thread; a
                # reader whose TID a host process holds (this tree is in the host's PID namespace)
                # does not start, and the reads go on without it
                assert {int(pid) for pid, _ in reads} == set(records), reads
                for pid, threads in reads:
                    assert int(threads) > 1 or re.search(rf"pie: {pid}: vsnap: page reader with TID \d+ not started \(-17\)",
                                                         text), (pid, threads)
            kill_restored(restored)
            restored = []
    finally:
        if root.poll() is None:
            root.kill()
            root.wait()
        if restored:
            kill_restored(restored)


def _children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
