"""The CPU engine's server holds fewer connections than it has descriptors, a flood of idle or
half-sent requests never locks a new client out (issue 26, item 3; hostile pass 14), and a request
late in its first byte, headers or body is closed: a real uvicorn server in this process."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from typing import Any, Iterator

import pytest
import uvicorn

from vsnap.engine.adapters.cpu.connections import BURSTS_IN_FLIGHT, bounded_protocol, connection_budget

CAP = 8


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


def serve(application: Any, protocol: type[Any]) -> Iterator[int]:
    sock = socket.create_server(("127.0.0.1", 0))
    config = uvicorn.Config(application, log_level="warning", lifespan="off", http=protocol, backlog=4)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    yield sock.getsockname()[1]
    server.should_exit = True
    thread.join(10)
    sock.close()


@pytest.fixture
def port() -> Iterator[int]:
    yield from serve(app, bounded_protocol(CAP))


def get(port: int) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
        conn.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        return conn.recv(1024)


def open_connections(port: int) -> int:
    """Sockets this process holds (the server's ends and the clients' both)."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            pass  # the listing's own descriptor
    return count


def test_a_flood_of_idle_connections_is_bounded_and_never_locks_a_client_out(port: int) -> None:
    before = open_connections(port)
    flood = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(CAP * 5)]
    half = flood[-1]
    half.sendall(b"GET /hea")  # half a request line: idle too
    time.sleep(0.5)
    # our CAP*5 client ends, plus at most CAP server ends (and the burst still closing)
    assert open_connections(port) - before <= len(flood) + CAP + 4
    assert get(port).startswith(b"HTTP/1.1 200")
    closed = 0
    for conn in flood:
        conn.settimeout(0.2)
        try:
            closed += conn.recv(1) == b""
        except (socket.timeout, ConnectionResetError):
            pass
        conn.close()
    assert closed >= len(flood) - CAP  # the idlest went first


BIG = b"x" * (8 << 20)  # more than a socket's buffers hold for a client that does not read


async def big_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(BIG))]})
    await send({"type": "http.response.body", "body": BIG})


@pytest.fixture
def big_port() -> Iterator[int]:
    yield from serve(big_app, bounded_protocol(CAP))


def test_a_connection_closed_for_room_frees_its_descriptor_though_its_client_never_reads(big_port: int) -> None:
    """Hostile pass 14: its answer complete (so idle) but unread, a connection closed to make room
    kept its descriptor until the client read, uncounted: such clients could use up the rest."""
    before = open_connections(big_port)
    stuck = []
    for _ in range(CAP):
        conn = socket.socket()
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        conn.connect(("127.0.0.1", big_port))
        conn.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        stuck.append(conn)
    time.sleep(0.5)  # every answer is written, as far as the server is concerned
    flood = [socket.create_connection(("127.0.0.1", big_port), timeout=5) for _ in range(CAP * 2)]
    time.sleep(0.5)
    try:
        # our CAP*3 client ends, plus at most CAP server ends (and the burst still closing)
        assert open_connections(big_port) - before <= len(stuck) + len(flood) + CAP + 4
    finally:
        for conn in stuck + flood:
            conn.close()


def test_the_budget_leaves_room_below_the_limit() -> None:
    small = connection_budget(limit=64, open_now=25)
    assert small.cap + BURSTS_IN_FLIGHT * small.burst + 16 <= 64 - 25 and small.cap >= 1
    flood = connection_budget(limit=200, open_now=25)  # hostile pass 14: accept() hit EMFILE under a flood
    assert flood.cap + BURSTS_IN_FLIGHT * flood.burst + 16 <= 200 - 25
    assert connection_budget(limit=20000, open_now=40).cap == 4096
    assert connection_budget(limit=10, open_now=30).cap == 1


async def reading_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Reads the whole body first (as FastAPI does), answers its length; /slow answers late."""
    body = b""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    if scope["path"] == "/slow":
        await asyncio.sleep(DEADLINE_S * 2)
    answer = str(len(body)).encode()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(answer))]})
    await send({"type": "http.response.body", "body": answer})


DEADLINE_S = 1.0  # the request deadline of the fixture's server (its first byte: half of it)


@pytest.fixture
def reading_port() -> Iterator[int]:
    """A server whose app reads bodies, with the engine's deadlines."""
    yield from serve(reading_app, bounded_protocol(CAP))


@pytest.fixture
def short_port() -> Iterator[int]:
    """The same with short deadlines: DEADLINE_S for a request, half of it for the first byte."""
    yield from serve(reading_app, bounded_protocol(CAP, DEADLINE_S / 2, DEADLINE_S))


def post(port: int, body: bytes = b"0123456789", path: str = "/") -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
        conn.sendall(b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s"
                     % (path.encode(), len(body), body))
        return conn.recv(1024)


HALF_BODY = b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n0123456789"


def closed_by_server(conn: socket.socket, drip: bytes = b"", bound_s: float = 30) -> bool:
    """Whether the server closes ``conn`` (sending ``drip`` every tenth of a second meanwhile)
    before ``bound_s``: a bound far past the deadlines, so that a test never hangs."""
    conn.settimeout(0.1)
    end = time.monotonic() + bound_s
    while time.monotonic() < end:
        try:
            if drip:
                conn.sendall(drip)
            if conn.recv(1024) == b"":
                return True
        except socket.timeout:
            continue
        except (ConnectionResetError, BrokenPipeError):
            return True
    return False


def test_a_flood_of_half_sent_bodies_never_locks_a_client_out(reading_port: int) -> None:
    """Hostile pass 14: connections that sent headers and part of their body counted as busy, so
    CAP of them made the server close every newcomer."""
    flood = []
    for _ in range(CAP * 3):
        conn = socket.create_connection(("127.0.0.1", reading_port), timeout=5)
        conn.sendall(HALF_BODY)
        flood.append(conn)
    time.sleep(0.5)  # every half body has reached the server
    try:
        assert post(reading_port).startswith(b"HTTP/1.1 200"), "a whole request was closed"
    finally:
        for conn in flood:
            conn.close()


@pytest.mark.parametrize("sent, drip", [
    (b"", b""),  # never a byte
    (b"POST / HTTP/1.1\r\nHost: x\r\nContent-", b""),  # half the headers
    (HALF_BODY, b""),  # the headers, part of the body
    (HALF_BODY, b"x"),  # the rest of the body a byte at a time: no drip extends the deadline
    (b"GET / HTTP/1.1\r\n", b"X-Drip: y\r\n"),  # headers dripped
])
def test_a_request_whose_first_byte_headers_or_body_come_late_is_closed(
        short_port: int, sent: bytes, drip: bytes) -> None:
    with socket.create_connection(("127.0.0.1", short_port), timeout=5) as conn:
        conn.sendall(sent)
        assert closed_by_server(conn, drip)
    assert post(short_port).startswith(b"HTTP/1.1 200")


def test_a_whole_request_is_answered_however_long_it_takes_and_keep_alive_requests_each_get_their_deadline(
        short_port: int) -> None:
    assert post(short_port, path="/slow").startswith(b"HTTP/1.1 200")  # answered after two deadlines
    with socket.create_connection(("127.0.0.1", short_port), timeout=30) as conn:
        for _ in range(3):  # each request comes whole, within its deadline, though the connection outlives it
            time.sleep(DEADLINE_S / 4)
            conn.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc")
            answer = b""
            while not answer.endswith(b"\r\n\r\n3"):  # the whole answer: its body is the length read
                answer += conn.recv(1024) or pytest.fail(f"closed after {answer!r}")
            assert answer.startswith(b"HTTP/1.1 200")
