"""HTTP on the host side of a tree: the listening socket vsnap binds and hands over, the URL a
client uses, and the health probe.

The probe is one request line over a plain socket, not urllib: urllib.request (with http.client,
email and ssl) was 12 to 19 ms of every restore's start (docs/benchmarks/NOTES.md).
"""

from __future__ import annotations

import socket
import time
import urllib.parse
from typing import Callable

from vsnap.protocol.errors import EngineError, HostNotReady


def server_url(host: str, port: int, *, tls: bool = False) -> str:
    """A URL a client can use: a wildcard address becomes loopback, IPv6 addresses are bracketed."""
    if host in ("0.0.0.0", ""):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    scheme = "https" if tls else "http"
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


def bind_listener(host: str, port: int) -> socket.socket:
    """The HTTP socket, bound on the host (the tree's own network namespace is not reachable)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(512)
    except OSError as exc:
        sock.close()
        raise HostNotReady("port", f"cannot serve on {host}:{port}: {exc.strerror}",
                           hint="choose another --port, or stop what listens there") from None
    return sock


def check_port_free(host: str, port: int) -> None:
    """Fail before CRIU runs if host:port cannot be bound (port 0: any free port, always fine)."""
    if port != 0:
        bind_listener(host, port).close()


def health_check(url: str, timeout_s: float = 30, stop: Callable[[], BaseException | None] | None = None) -> None:
    """GET ``url``/health until it answers 200 (EngineError HealthCheckFailed after ``timeout_s``,
    a deadline no server can stretch by answering slowly); between attempts ``stop`` may name a
    reason to give up (the tree's error, the tree gone), which is raised.

    One request line over a plain socket, not urllib: urllib.request (with http.client, email and
    ssl) was 12 to 19 ms of every restore's start, and its getaddrinfo of the host imported the
    idna codec in the serve phase. What a failure reports keeps urllib's wording. No proxy is
    asked (urllib would have sent even 127.0.0.1 through $http_proxy unless $no_proxy named it).
    """
    parts = urllib.parse.urlsplit(url)
    tls = parts.scheme == "https"
    host, port = parts.hostname or "127.0.0.1", parts.port or (443 if tls else 80)
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        answer = _get_health(host, port, deadline=min(deadline, time.monotonic() + 5), tls=tls)
        if answer is None:
            return
        last = answer
        reason = stop() if stop is not None else None
        if reason is not None:
            raise reason
        time.sleep(0.02)
    raise EngineError("serve", "HealthCheckFailed", f"{url}/health did not answer 200 ({last})")


def _get_health(host: str, port: int, deadline: float, *, tls: bool = False) -> str | None:
    """One GET /health, given up at ``deadline`` (time.monotonic()): None if it answered 200, else
    what it did (in urllib's words). Over TLS the certificate is not checked: this asks the tree
    vsnap restored, on the socket vsnap still holds, whether it serves; what a client trusts is
    the client's to check."""
    netloc = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def left() -> float:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("timed out")
        return remaining

    try:
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    except OSError as exc:
        return f"<urlopen error {exc}>"
    if tls:
        import ssl  # only for a server that speaks TLS (12 to 19 ms with urllib: see health_check)

        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        sock = context.wrap_socket(sock, server_hostname=host, do_handshake_on_connect=True)
    with sock:
        try:
            sock.settimeout(left())
            sock.connect((host, port))
            sock.settimeout(left())
            sock.sendall(f"GET /health HTTP/1.1\r\nHost: {netloc}\r\nConnection: close\r\n\r\n".encode())
        except OSError as exc:
            return f"<urlopen error {exc}>"
        status_line = b""
        try:
            while not status_line.endswith(b"\n") and len(status_line) < 65537:
                sock.settimeout(left())  # per read, against the one deadline: a trickle cannot stretch it
                chunk = sock.recv(min(4096, 65537 - len(status_line)))
                if not chunk:
                    break
                status_line += chunk
                if b"\n" in status_line:
                    status_line = status_line[:status_line.index(b"\n") + 1]
        except OSError as exc:
            return str(exc)
    if not status_line:
        return "Remote end closed connection without response"
    version, _, rest = status_line.decode("latin-1").rstrip("\r\n").partition(" ")
    code, _, reason = rest.partition(" ")
    if not version.startswith("HTTP/") or not code.isdigit():
        return f"not an HTTP answer: {status_line[:80]!r}"
    if code == "200":
        return None
    return f"HTTP {code}" if code.startswith("2") else f"HTTP Error {code}: {reason.strip()}"
