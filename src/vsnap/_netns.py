"""Each tree runs in its own network namespace.

Two instances of one image must not share a network namespace: their restored sockets would
collide (the CUDA driver's abstract `@cuda-uvmfd-<pidns>-<pid>@` socket, vLLM's TCPStore on
127.0.0.1). So the tree runs in a fresh network namespace with only loopback, declared external
to CRIU (as runc does): the dump does not save it, and each restore hands CRIU a new one through
`--inherit-fd`. The HTTP socket is bound on the host by the orchestrator and passed into the tree
(SCM_RIGHTS) once the oracle has passed, so the server is reachable from the host.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from ._errors import ProcessTreeError
from ._proctree import find_unshare

NETNS_KEY = "vsnap-net"
def netns_inode(pid: int) -> int:
    return os.stat(f"/proc/{pid}/ns/net").st_ino


class NetnsHolder:
    """A process that creates a fresh network namespace (loopback up) and keeps it alive until a
    restore has put the tree into it; ``fd`` is the namespace, for CRIU's --inherit-fd."""

    def __init__(self) -> None:
        code = "import signal; from vsnap._loopback import loopback_up; loopback_up(); print('up', flush=True); signal.pause()"
        src = str(Path(__file__).resolve().parent.parent)
        env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
        self.process = subprocess.Popen([find_unshare(), "--net", sys.executable, "-c", code], stdout=subprocess.PIPE,
                                        stdin=subprocess.DEVNULL, env=env)
        assert self.process.stdout is not None
        if self.process.stdout.readline().strip() != b"up":
            self.close()
            raise ProcessTreeError(None, "could not create a network namespace for the restored tree",
                                   phase="prepare host", hint="run as root on a kernel with network namespaces")
        self.fd = os.open(f"/proc/{self.process.pid}/ns/net", os.O_RDONLY)

    def close(self) -> None:
        if getattr(self, "fd", None) is not None:
            os.close(self.fd)
            self.fd = None  # type: ignore[assignment]
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
        self.process.wait()
