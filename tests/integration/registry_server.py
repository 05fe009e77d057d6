"""A real OCI registry on loopback for tests and benchmarks: Debian's docker-registry (the CNCF
distribution registry 2.8), filesystem storage in a directory of the caller's, http on
127.0.0.1 at a free port; started and stopped by its owner, never a system service."""

from __future__ import annotations

import re
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

DOCKER_REGISTRY = shutil.which("docker-registry") or "/usr/bin/docker-registry"
# distribution's access log (gorilla/handlers' combined format): "GET /v2/... HTTP/1.1" 206 67108864
ACCESS_LINE = re.compile(r'"(?P<method>[A-Z]+) (?P<path>\S+) HTTP/[0-9.]+" (?P<status>[0-9]{3}) (?P<bytes>[0-9]+|-)')


@dataclass(frozen=True)
class AccessLine:
    method: str
    path: str
    status: int
    bytes: int


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalRegistry:
    """``with LocalRegistry(root) as registry:`` serves ``registry.address`` until the block ends."""

    def __init__(self, root: Path, *, htpasswd: Path | None = None, access_log: bool = False) -> None:
        self.root = root
        self.storage = root / "storage"
        self.htpasswd = htpasswd
        self.access_log = access_log  # each request's line (combined log format) in registry.log: ``requests()``
        self.process: subprocess.Popen[bytes] | None = None
        self.address = ""

    def __enter__(self) -> "LocalRegistry":
        self.root.mkdir(parents=True, exist_ok=True)
        for _ in range(3):  # another process may take the free port before the registry binds it
            port = free_port()
            config = self.root / "config.yml"
            auth = (f"auth:\n  htpasswd:\n    realm: vsnap-test\n    path: {self.htpasswd}\n"
                    if self.htpasswd else "")
            config.write_text(f"version: 0.1\nlog:\n  level: warn\n  accesslog:\n"
                              f"    disabled: {'false' if self.access_log else 'true'}\n"
                              f"storage:\n  filesystem:\n    rootdirectory: {self.storage}\n"
                              f"http:\n  addr: 127.0.0.1:{port}\n{auth}")
            log = open(self.root / "registry.log", "ab")
            self.process = subprocess.Popen([DOCKER_REGISTRY, "serve", str(config)], stdout=log, stderr=log,
                                            stdin=subprocess.DEVNULL, start_new_session=True)
            log.close()
            self.address = f"127.0.0.1:{port}"
            if self._wait_ready():
                return self
            self.stop()
        raise RuntimeError(f"docker-registry did not start; see {self.root / 'registry.log'}")

    def _wait_ready(self, timeout_s: float = 15.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                return False
            try:
                urllib.request.urlopen(f"http://{self.address}/v2/", timeout=2).close()
                return True
            except urllib.error.HTTPError as exc:
                return exc.code == 401  # up, and asking for a login
            except OSError:
                time.sleep(0.05)
        return False

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        self.process = None

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def requests(self) -> list[AccessLine]:
        """The requests the registry logged so far (``access_log=True``), in order."""
        text = (self.root / "registry.log").read_text(errors="replace")
        return [AccessLine(m["method"], m["path"], int(m["status"]), int(m["bytes"]) if m["bytes"] != "-" else 0)
                for m in ACCESS_LINE.finditer(text)]

    def blob_path(self, digest: str) -> Path:
        """Where the registry keeps a blob's bytes (distribution's filesystem layout)."""
        hexdigest = digest.removeprefix("sha256:")
        return self.storage / "docker/registry/v2/blobs/sha256" / hexdigest[:2] / hexdigest / "data"


def htpasswd_line(user: str, password: str) -> str:
    """A bcrypt htpasswd entry (the only kind distribution accepts), through libcrypt."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import crypt

    hashed = crypt.crypt(password, crypt.mksalt(crypt.METHOD_BLOWFISH))
    if not hashed or not hashed.startswith("$2"):
        raise RuntimeError("this libcrypt cannot make bcrypt hashes")
    return f"{user}:{hashed}\n"

