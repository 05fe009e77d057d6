"""Each tree runs in its own network namespace.

Two instances of one image must not share a network namespace: their restored sockets would
collide (the CUDA driver's abstract `@cuda-uvmfd-<pidns>-<pid>@` socket, vLLM's TCPStore on
127.0.0.1). So the tree runs in a fresh network namespace with only loopback, declared external
to CRIU (as runc does): the dump does not save it, and each restore hands CRIU a new one through
`--inherit-fd`. The HTTP socket is bound on the host by the orchestrator and passed into the tree
(SCM_RIGHTS) once the oracle has passed, so the server is reachable from the host.
"""

from __future__ import annotations

import ctypes
import os
import threading

from vsnap.protocol.errors import ProcessTreeError
from vsnap.protocol.loopback import loopback_up

NETNS_KEY = "vsnap-net"


def netns_inode(pid: int) -> int:
    return os.stat(f"/proc/{pid}/ns/net").st_ino


CLONE_NEWNET = 0x40000000


class NetnsHolder:
    """A fresh network namespace (loopback up), held by an open fd for CRIU's --inherit-fd.

    Made in a short-lived thread: unshare(CLONE_NEWNET) moves only the calling thread, which
    brings `lo` up, opens its namespace and goes back; no helper process is started.
    """

    def __init__(self) -> None:
        result: dict[str, object] = {}

        def make() -> None:
            libc = ctypes.CDLL(None, use_errno=True)
            original = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
            try:
                if libc.unshare(CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
                try:
                    loopback_up()
                    result["fd"] = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
                finally:
                    libc.setns(original, CLONE_NEWNET)
            except OSError as exc:
                result["error"] = exc
            finally:
                os.close(original)

        thread = threading.Thread(target=make, name="vsnap-netns")
        thread.start()
        thread.join()
        if "fd" not in result:
            raise ProcessTreeError(None, f"could not create a network namespace for the restored tree: {result.get('error')}",
                                   phase="criu restore", hint="run as root on a kernel with network namespaces")
        self.fd: int | None = int(result["fd"])  # type: ignore[call-overload]

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
