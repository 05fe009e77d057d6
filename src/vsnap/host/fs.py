"""renameat2(2): a rename with flags, which os.rename cannot pass.

Two of vsnap's renames need more than rename(2): publishing an image swaps the new one with the
old in one step (RENAME_EXCHANGE: a good image is never lost to a failed capture), and `vsnap rm`
moves an image aside under a fresh name without ever replacing what may stand there
(RENAME_NOREPLACE). Python's os module has no renameat2, so the C library's (glibc 2.28 and
later) is called through ctypes, here only.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
from pathlib import Path
from typing import Any

RENAME_NOREPLACE = 1  # <linux/fs.h>
RENAME_EXCHANGE = 2
_AT_FDCWD = -100


@functools.cache
def _renameat2() -> Any | None:
    """The C library's renameat2, typed; None where it has none."""
    function = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if function is not None:
        function.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint)
        function.restype = ctypes.c_int
    return function


def renameat2(source: Path, destination: Path, flags: int) -> None:
    """Rename ``source`` to ``destination`` with renameat2 ``flags`` (RENAME_EXCHANGE,
    RENAME_NOREPLACE), as rename(2) resolves paths. Raises OSError with the call's errno, naming
    both paths: ENOSYS where the C library (or the kernel) has no renameat2, EINVAL where the
    filesystem does not support the flag, EEXIST for RENAME_NOREPLACE onto an existing name. The
    caller chooses its fallback: no flag can be emulated without a race."""
    function = _renameat2()
    code = errno.ENOSYS
    if function is not None:
        if function(_AT_FDCWD, os.fsencode(source), _AT_FDCWD, os.fsencode(destination), flags) == 0:
            return
        code = ctypes.get_errno()
    raise OSError(code, os.strerror(code), str(source), None, str(destination))
