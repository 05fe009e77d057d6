"""Our CRIU patch 0003: a restored process keeps the permission to use AMX's tile data.

Since Linux 5.16 a process asks for AMX tile data (arch_prctl ARCH_REQ_XCOMP_PERM) before its
first tile instruction, and the kernel keeps that permission per process; CRIU 4.2.1 does not
carry it, so a restored process that had asked dies of SIGILL at its next tile instruction (every
restore of vLLM's CPU backend on a Xeon with AMX did, in its oracle). Real CRIU, a real process
running real tile instructions before the dump and after the restore. Skipped where the CPU or
the kernel has no AMX.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vsnap.host.criu.options import DumpOptions, RestoreOptions
from vsnap.host.criu.runner import CriuRunner

pytestmark = pytest.mark.criu

ARCH_GET_XCOMP_SUPP = 0x1021
XFEATURE_XTILEDATA = 18

# Asks for tile data, runs LDTILECFG / TILEZERO / TILERELEASE once, says so; on SIGUSR1 runs them
# again and writes what the kernel permits now into STATUS/after.
AMX = r"""
import ctypes, mmap, os, signal, sys
status = sys.argv[1]
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
ARCH_GET_XCOMP_PERM, ARCH_REQ_XCOMP_PERM, SYS_arch_prctl = 0x1022, 0x1023, 158

def permitted():
    value = ctypes.c_ulong()
    assert libc.syscall(SYS_arch_prctl, ARCH_GET_XCOMP_PERM, ctypes.byref(value)) == 0
    return value.value

# ldtilecfg [rdi]; tilezero tmm0; tilerelease; ret
code = bytes.fromhex("c4e2784907" "c4e27b49c0" "c4e27849c0" "c3")
page = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
page.write(code)
tiles = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(ctypes.addressof(ctypes.c_char.from_buffer(page)))
config = (ctypes.c_uint8 * 64)()
config[0] = 1                  # palette 1
config[16] = 64                # tmm0: 64 bytes a row (colsb[0], little-endian u16)
config[48] = 16                # tmm0: 16 rows

def write(name, text):
    with open(f"{status}/{name}.tmp", "w") as f:
        f.write(text)
    os.rename(f"{status}/{name}.tmp", f"{status}/{name}")

assert libc.syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, 18) == 0, ctypes.get_errno()
tiles(ctypes.addressof(config))
def again(signum, frame):
    tiles(ctypes.addressof(config))          # SIGILL here if the permission was lost
    write("after", hex(permitted()))
signal.signal(signal.SIGUSR1, again)
write("before", hex(permitted()))
while True:
    signal.pause()
"""


def amx_unavailable() -> str | None:
    flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    if "amx_tile" not in flags.split():
        return "this CPU has no AMX"
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    supported = ctypes.c_ulong()
    if libc.syscall(158, ARCH_GET_XCOMP_SUPP, ctypes.byref(supported)) != 0 or \
            not supported.value & (1 << XFEATURE_XTILEDATA):
        return "this kernel does not offer AMX tile data"
    return None


def wait_for(path: Path, process: subprocess.Popen | None = None, timeout: float = 30.0) -> str:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if process is not None and process.poll() is not None:
            raise AssertionError(f"the process ended ({process.returncode}) before {path.name}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {path.name}")
        time.sleep(0.05)
    return path.read_text()


def test_a_restored_process_may_still_use_amx_tiles(tmp_path: Path) -> None:
    reason = amx_unavailable()
    if reason:
        pytest.skip(reason)
    runner = CriuRunner.locate()
    status, images, work = tmp_path / "status", tmp_path / "images", tmp_path / "work"
    for d in (status, images, work):
        d.mkdir()
    process = subprocess.Popen([sys.executable, "-c", AMX, str(status)], stdin=subprocess.DEVNULL,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, cwd="/")
    pid = None
    try:
        before = int(wait_for(status / "before", process), 16)
        assert before & (1 << XFEATURE_XTILEDATA)
        runner.dump(DumpOptions(pid=process.pid, images_dir=images, log_file=work / "dump.log"), timeout_s=120)
        assert process.wait(timeout=10) == -signal.SIGKILL
        pid = runner.restore(RestoreOptions(images_dir=images, work_dir=work, log_file=work / "restore.log",
                                            pidfile=work / "restore.pid"), timeout_s=120)
        assert pid == process.pid
        os.kill(pid, signal.SIGUSR1)
        deadline = time.monotonic() + 30
        while not (status / "after").exists():
            state = Path(f"/proc/{pid}/stat").read_text().split()[2] if os.path.exists(f"/proc/{pid}") else "gone"
            assert state not in ("Z", "gone"), "the restored process died at its tile instruction (SIGILL)"
            assert time.monotonic() < deadline, "timed out waiting for the restored process"
            time.sleep(0.05)
        assert int((status / "after").read_text(), 16) == before
    finally:
        for target in {process.pid, pid} - {None}:
            try:
                os.kill(target, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.waitpid(process.pid, os.WNOHANG)
        except ChildProcessError:
            pass
