"""The io_uring filter (engine/seccomp.py), in a real child process: io_uring_setup fails with
ENOSYS after it, for the process and its children; other system calls are untouched."""

from __future__ import annotations

import subprocess
import sys

PROBE = r"""
import ctypes, os, sys
from vsnap.engine.seccomp import block_io_uring
libc = ctypes.CDLL(None, use_errno=True)
def setup():
    params = ctypes.create_string_buffer(120)
    fd = libc.syscall(425, 4, params)
    if fd >= 0:
        os.close(fd)
    return fd >= 0, ctypes.get_errno()
before = setup()
block_io_uring()
after = setup()
pid = os.fork()
if pid == 0:
    os._exit(0 if setup() == (False, 38) else 1)
_, status = os.waitpid(pid, 0)
child = os.waitstatus_to_exitcode(status) == 0
execed = __import__("subprocess").run([sys.executable, "-c", "print('exec works')"],
                                      capture_output=True, text=True).stdout.strip()
print(after, child, execed)
"""


def test_io_uring_setup_fails_with_enosys_in_the_process_and_its_children() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True).stdout.split()
    # ENOSYS (38), whatever the kernel's own io_uring setting (EPERM when disabled by sysctl), in
    # the process, a fork and an exec'd child
    assert out == ["(False,", "38)", "True", "exec", "works"]
