"""Keep io_uring out of the engine tree without touching a host-wide sysctl.

CRIU cannot dump an io_uring, and libuv (uvloop, inside vLLM's processes) creates one even with
UV_USE_IO_URING=0. The old way was `sysctl kernel.io_uring_disabled=2`, which disables io_uring
for every process on the host. Instead the tree's root installs a seccomp filter before anything
else runs: ``io_uring_setup`` fails with ENOSYS (as on a kernel without io_uring), so libuv and
everything else falls back to epoll, and no io_uring can exist in the tree. The filter is
inherited by every process the root starts (fork and exec), and CRIU dumps and restores it with
the tree (`criu check --feature seccomp_filters`).

No other system call is touched. It sets PR_SET_NO_NEW_PRIVS, as an unprivileged seccomp filter
requires: no process of the tree can gain privileges through a setuid binary (none needs to).
"""

from __future__ import annotations

import ctypes
import os
import platform
import struct

PR_SET_NO_NEW_PRIVS = 38
PR_SET_SECCOMP = 22
PR_GET_SECCOMP = 21
SECCOMP_MODE_FILTER = 2
SECCOMP_RET_ALLOW = 0x7FFF0000
SECCOMP_RET_ERRNO = 0x00050000
ENOSYS = 38

# (AUDIT_ARCH_*, io_uring_setup's number): x86_64 and the asm-generic table (aarch64) agree on 425
ARCHES = {"x86_64": (0xC000003E, 425), "aarch64": (0xC00000B7, 425)}

# classic BPF
BPF_LD_W_ABS = 0x20  # BPF_LD | BPF_W | BPF_ABS
BPF_JEQ_K = 0x15     # BPF_JMP | BPF_JEQ | BPF_K
BPF_RET_K = 0x06     # BPF_RET | BPF_K
SECCOMP_DATA_NR, SECCOMP_DATA_ARCH = 0, 4


def _insn(code: int, jt: int, jf: int, k: int) -> bytes:
    return struct.pack("HBBI", code, jt, jf, k)


def io_uring_filter(machine: str | None = None) -> bytes:
    """The BPF program: on this architecture, io_uring_setup -> ENOSYS; everything else allowed."""
    arch, nr = ARCHES[machine or platform.machine()]
    return b"".join([
        _insn(BPF_LD_W_ABS, 0, 0, SECCOMP_DATA_ARCH),
        _insn(BPF_JEQ_K, 0, 3, arch),                    # another ABI: allow
        _insn(BPF_LD_W_ABS, 0, 0, SECCOMP_DATA_NR),
        _insn(BPF_JEQ_K, 0, 1, nr),
        _insn(BPF_RET_K, 0, 0, SECCOMP_RET_ERRNO | ENOSYS),
        _insn(BPF_RET_K, 0, 0, SECCOMP_RET_ALLOW),
    ])


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def block_io_uring() -> None:
    """Install the filter on this process (and so on everything it starts). Raises OSError."""
    program = io_uring_filter()
    buffer = ctypes.create_string_buffer(program, len(program))
    fprog = _SockFprog(len(program) // 8, ctypes.cast(buffer, ctypes.c_void_p))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, None, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), f"prctl(PR_SET_NO_NEW_PRIVS): {os.strerror(ctypes.get_errno())}")
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), f"prctl(PR_SET_SECCOMP): {os.strerror(ctypes.get_errno())}")
