"""The CPU engine's server holds fewer connections than it has descriptors, and a flood of idle
ones never locks a new client out (issue 26, item 3): a real uvicorn server in this process."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from typing import Any, Iterator

import pytest
import uvicorn

from vsnap.engine.adapters.cpu.connections import bounded_protocol, connection_budget

CAP = 8


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture
def port() -> Iterator[int]:
    sock = socket.create_server(("127.0.0.1", 0))
    config = uvicorn.Config(app, log_level="warning", lifespan="off", http=bounded_protocol(CAP), backlog=4)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    yield sock.getsockname()[1]
    server.should_exit = True
    thread.join(10)
    sock.close()


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


def test_the_budget_leaves_room_below_the_limit() -> None:
    small = connection_budget(limit=64, open_now=25)
    assert small.cap + small.burst + 16 <= 64 - 25 and small.cap >= 1
    assert connection_budget(limit=20000, open_now=40).cap == 4096
    assert connection_budget(limit=10, open_now=30).cap == 1
