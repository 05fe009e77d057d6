"""HTTP to a registry with every byte bounded and every wait under a deadline a drip cannot extend.

A registry is hostile input. requests alone reads a redirect's body whole, decodes gzip and
deflate without a bound (2 MB of gzip became 8.9 GB of memory), and its timeouts are per read: a
body dripped at a byte a second, or headers dripped a line at a time, never end. So here:

- every request streams, follows no redirect itself (``client`` follows them without reading
  their bodies), and asks for ``Accept-Encoding: identity``; a body is read raw, and a gzip or
  deflate ``Content-Encoding`` is decoded here with zlib's ``max_length``, a piece at a time, so
  a caller's limit applies to decoded bytes before they are buffered; any other encoding is refused.
- every exchange is a ``Transfer``: its sockets (registered by the connection class this module
  mounts, from the moment each is made or reused, so the TLS handshake and the headers count too)
  are shut down once the exchange has lasted ``grace`` seconds and its bytes, sent and received,
  average below ``MIN_BYTES_PER_S``: at ``start + max(grace, bytes / MIN_BYTES_PER_S)``. A timer
  enforces it, not the reads, so a read that never returns is ended too.

``VSNAP_REGISTRY_DEADLINE_S`` sets the grace (default 120 s); tests lower it.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import zlib
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from vsnap.protocol.errors import RegistryUnavailable

CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 120.0
MIN_BYTES_PER_S = 64 * 1024  # slower than this on average, after the grace, is given up
DEADLINE_ENV = "VSNAP_REGISTRY_DEADLINE_S"
RAW_CHUNK = 256 << 10
DEADLINE_HINT = (f"check the registry and the network, then run the command again (a pull keeps the files it "
                 f"checked); {DEADLINE_ENV} sets the grace")


def grace_s() -> float:
    """The grace of every exchange: ``VSNAP_REGISTRY_DEADLINE_S`` if it is a positive number, else 120 s."""
    try:
        value = float(os.environ.get(DEADLINE_ENV, ""))
    except ValueError:
        return READ_TIMEOUT_S
    return value if 0 < value < 1e6 else READ_TIMEOUT_S


_CURRENT = threading.local()


class Expired(Exception):
    """A body ended because its Transfer's deadline shut its connection (an end without a
    Content-Length looks like any other end): the caller reports the deadline."""


class Transfer:
    """One exchange's deadline (module docstring): ``watch`` takes its sockets, ``progress`` counts
    its bytes, and once the deadline passes its sockets are shut down and ``expired`` is set, so the
    read or write blocked on them fails at once; ``close`` ends the watch."""

    def __init__(self, grace: float | None = None, min_rate: float = MIN_BYTES_PER_S) -> None:
        self.grace = grace_s() if grace is None else grace
        self.min_rate = min_rate
        self.start = time.monotonic()
        self.bytes = 0
        self.expired = False
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()
        self._done = False
        self._timer: threading.Timer | None = None
        self._arm()

    def _expiry(self) -> float:
        return self.start + max(self.grace, self.bytes / self.min_rate)

    def _arm(self) -> None:
        self._timer = threading.Timer(max(0.0, self._expiry() - time.monotonic()) + 0.01, self._check)
        self._timer.daemon = True
        self._timer.start()

    def _check(self) -> None:
        with self._lock:
            if self._done:
                return
            if time.monotonic() < self._expiry():
                self._arm()  # bytes came meanwhile: the deadline moved with them
                return
            self.expired = True
            for sock in self._socks:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def watch(self, sock: Any) -> None:
        """Shut ``sock``'s connection down at the deadline (through a duplicate of its descriptor:
        a TLS socket takes over the plain one's, and shutdown acts on the connection, not the fd)."""
        try:
            dup = socket.socket(fileno=os.dup(sock.fileno()))
        except (OSError, ValueError):
            return
        with self._lock:
            if self._done:
                dup.close()
                return
            self._socks.append(dup)
            if self.expired:
                dup.shutdown(socket.SHUT_RDWR)

    def progress(self, nbytes: int) -> None:
        self.bytes += nbytes

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def close(self) -> None:
        with self._lock:
            self._done = True
            if self._timer is not None:
                self._timer.cancel()
            for sock in self._socks:
                sock.close()
            self._socks.clear()

    @contextmanager
    def current(self) -> Iterator["Transfer"]:
        """The sockets this thread makes or reuses meanwhile are this transfer's."""
        before = getattr(_CURRENT, "transfer", None)
        _CURRENT.transfer = self
        try:
            yield self
        finally:
            _CURRENT.transfer = before

    def refusal(self, registry: str, what: str) -> RegistryUnavailable:
        return RegistryUnavailable(registry, f"registry {registry} did not finish {what} in time ({self.bytes} "
                                             f"bytes in {self.elapsed():.0f} s; vsnap gives up after "
                                             f"{self.grace:g} s below {self.min_rate / 1024:.0f} KiB/s)",
                                   hint=DEADLINE_HINT)


def _watch_current(sock: Any) -> None:
    transfer = getattr(_CURRENT, "transfer", None)
    if transfer is not None and sock is not None:
        transfer.watch(sock)


def counted(data: Any, transfer: Transfer) -> Any:
    """A request body that counts what is sent into ``transfer`` (bytes: counted at once; a file:
    each read; an iterable: each chunk)."""
    if data is None or isinstance(data, (bytes, bytearray)):
        transfer.progress(len(data or b""))
        return data
    if hasattr(data, "read"):
        return _CountingReader(data, transfer)
    return (transfer.progress(len(chunk)) or chunk for chunk in data)


class _CountingReader:
    """A file read by http.client (it has ``read`` and no ``__iter__``, so requests sends it as is
    with the Content-Length the caller gives)."""

    def __init__(self, file: Any, transfer: Transfer) -> None:
        self._file, self._transfer = file, transfer

    def read(self, size: int = -1) -> bytes:
        data = self._file.read(size)
        self._transfer.progress(len(data))
        return data


class _Decoder:
    """A body's Content-Encoding undone a bounded piece at a time (identity, gzip, deflate)."""

    def __init__(self, encoding: str, refuse: Callable[[str], Exception]) -> None:
        encoding = encoding.strip().lower()
        if encoding in ("", "identity"):
            self._zlib = None
        elif encoding in ("gzip", "x-gzip", "deflate"):
            self._zlib = zlib.decompressobj(32 + zlib.MAX_WBITS)  # gzip or zlib, by the header
        else:
            raise refuse(f"Content-Encoding {encoding[:40]!r}, which vsnap does not decode (it asks for identity)")
        self._refuse = refuse

    def pieces(self, data: bytes, piece: int) -> Iterator[bytes]:
        if self._zlib is None:
            yield data
            return
        try:
            while data:
                out = self._zlib.decompress(data, piece)
                data = self._zlib.unconsumed_tail
                if out:
                    yield out
                if self._zlib.eof:  # gzip may hold several members, one after another
                    data = self._zlib.unused_data
                    self._zlib = zlib.decompressobj(32 + zlib.MAX_WBITS)
        except zlib.error as exc:
            raise self._refuse(f"a body that is not valid gzip/deflate ({exc})") from None


def body(response: Any, transfer: Transfer, refuse: Callable[[str], Exception], *, limit: int | None = None,
         too_long: Callable[[], Exception] | None = None, piece: int = RAW_CHUNK) -> Iterator[bytes]:
    """``response``'s body, decoded, in pieces of at most ``piece`` bytes; more than ``limit``
    decoded bytes raises ``too_long()`` before they are kept. Reads raw (urllib3 decodes nothing)."""
    decoder = _Decoder(response.headers.get("Content-Encoding", ""), refuse)
    total = 0
    raw = response.raw
    while True:
        data = raw.read(piece, decode_content=False)
        if not data:
            if transfer.expired:
                raise Expired()
            break
        transfer.progress(len(data))
        for out in decoder.pieces(data, piece):
            total += len(out)
            if limit is not None and total > limit:
                raise (too_long or (lambda: refuse(f"a body over {limit} bytes")))()
            yield out


def read_body(response: Any, transfer: Transfer, refuse: Callable[[str], Exception], limit: int,
              too_long: Callable[[], Exception] | None = None) -> bytes:
    """The whole (small) body, at most ``limit`` decoded bytes."""
    return b"".join(body(response, transfer, refuse, limit=limit, too_long=too_long, piece=min(limit + 1, RAW_CHUNK)))


_ADAPTER: Any = None


def adapter_class(requests: Any) -> Any:
    """requests' HTTPAdapter whose connections register their sockets with the current Transfer
    (when made, so the handshake counts, and at each request on a reused one), with a connect and
    read timeout on every request (the read timeout: at most the grace)."""
    global _ADAPTER
    if _ADAPTER is not None:
        return _ADAPTER
    from urllib3.connection import HTTPConnection, HTTPSConnection
    from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool

    def watched(base: Any) -> Any:
        class Watched(base):  # type: ignore[misc,valid-type]
            def _new_conn(self) -> Any:
                sock = super()._new_conn()
                _watch_current(sock)
                return sock

            def request(self, *args: Any, **kwargs: Any) -> Any:
                _watch_current(self.sock)
                return super().request(*args, **kwargs)
        return Watched

    class Pool(HTTPConnectionPool):
        ConnectionCls = watched(HTTPConnection)

    class TlsPool(HTTPSConnectionPool):
        ConnectionCls = watched(HTTPSConnection)

    pools = {"http": Pool, "https": TlsPool}

    class Adapter(requests.adapters.HTTPAdapter):
        def init_poolmanager(self, *args: Any, **kwargs: Any) -> None:
            super().init_poolmanager(*args, **kwargs)
            self.poolmanager.pool_classes_by_scheme = pools

        def proxy_manager_for(self, proxy: Any, **kwargs: Any) -> Any:
            manager = super().proxy_manager_for(proxy, **kwargs)
            manager.pool_classes_by_scheme = pools
            return manager

        def send(self, request: Any, **kwargs: Any) -> Any:  # type: ignore[override]
            if kwargs.get("timeout") is None:
                kwargs["timeout"] = (CONNECT_TIMEOUT_S, min(READ_TIMEOUT_S, grace_s()))
            return super().send(request, **kwargs)

    _ADAPTER = Adapter
    return Adapter


def new_session(requests: Any) -> Any:
    """A requests session for one registry client: the adapter above, identity encoding, no
    redirect of its own (the client follows them), and no credentials of its own (no .netrc: the
    client adds Authorization only for the registry's origin)."""
    class Session(requests.Session):  # type: ignore[misc,name-defined]
        def get_redirect_target(self, response: Any) -> None:
            return None  # requests reads a redirect's body whole, even with allow_redirects=False

    session = Session()
    session.headers["Accept-Encoding"] = "identity"
    session.auth = lambda request: request  # requests would add .netrc credentials for any host otherwise
    for prefix in ("http://", "https://"):
        session.mount(prefix, adapter_class(requests)())
    return session
