"""The CPU engine's server holds fewer client connections than it has descriptors, and no client
holds one for long without a whole request.

A restored tree's root is the server: the same descriptor table holds its clients' connections,
the files of its control directory (the owner watchdog reads owner.json every second), its log and
its worker pipe. Idle connections cost a client nothing, and uvicorn keeps one that never sends a
byte forever: 20,200 of them (100 under `ulimit -n 64`) used up every descriptor (hostile pass 12).

So the server keeps at most ``cap`` connections, below its RLIMIT_NOFILE with room to spare for
its own files and for the accepts in flight: asyncio accepts up to ``backlog`` connections per
turn of the loop, makes their transports a turn later and counts them (connection_made) a turn
after that, and the descriptor of a connection closed to make room goes a turn later still, so
under a flood three bursts are open beyond the count (with room for one only, hostile pass 14 saw
accept() fail with EMFILE). A connection beyond the cap closes the one that has been idle
longest: one answering no request it has received in full (it never sent a byte, sent part of a
request line, its headers or its body, or waits between keep-alive requests), so a flood of idle
or half-sent requests cannot lock new clients out; when every connection is answering a request,
the newcomer is closed instead. Closed at once (abort): a close() waits until the client has read
what is still buffered for it, and one that never reads would keep the descriptor, no longer
counted (hostile pass 14). uvicorn's ``limit_concurrency`` does not
bound descriptors (it accepts, then answers 503) and would refuse everyone once idle clients hold
the count (hostile pass 2).

And uvicorn has no deadline for a request's headers or body: a client that sends headers with a
Content-Length and then part of the body, or drips it a byte at a time, held its connection (and
the body buffered so far) forever (hostile pass 14). So a new connection must send its first byte
within ``first_byte_s``, and a request its headers and whole body within ``request_s`` of its first
byte: a fixed deadline that no drip extends. Either missed, the connection is closed at once (no
answer: the application may already be reading the body). Between keep-alive requests uvicorn's own
``timeout_keep_alive`` applies.
"""

from __future__ import annotations

import asyncio
import os
import resource
from dataclasses import dataclass
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

MAX_CONNECTIONS = 4096  # far more than the engine answers at once (8 running, 64 waiting)
MAX_BURST = 128
BURSTS_IN_FLIGHT = 3  # accepted, not yet counted (two turns) or closed, not yet released (one turn)
FIRST_BYTE_S = 5.0  # a new connection's first byte
# A request's headers and body, from its first byte (bodies are at most 1 MiB: 50 KiB/s at least)
REQUEST_S = 20.0


@dataclass(frozen=True)
class ConnectionBudget:
    cap: int  # client connections held at most
    burst: int  # the listen backlog, and so the most accepted in one turn of the event loop


def connection_budget(limit: int | None = None, open_now: int | None = None) -> ConnectionBudget:
    """What the server may hold, from its descriptor limit and the descriptors open now: an
    eighth of the rest (at least 16) stays for the tree's own files, and BURSTS_IN_FLIGHT bursts
    of accepts (each an eighth, at most MAX_BURST) for the connections in flight."""
    if limit is None:
        limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if open_now is None:
        open_now = len(os.listdir("/proc/self/fd"))
    headroom = max(limit - open_now, 0)
    reserve = max(16, headroom // 8)
    burst = max(1, min(MAX_BURST, headroom // 8))
    return ConnectionBudget(cap=max(1, min(MAX_CONNECTIONS, headroom - reserve - BURSTS_IN_FLIGHT * burst)),
                            burst=burst)


def _idle(protocol: H11Protocol) -> bool:
    """Answering no request it has received in full: no cycle yet (nothing or part of a request
    line or headers received), its body still arriving, or its response complete (a keep-alive
    connection between requests, or with part of its next request)."""
    cycle = protocol.cycle
    return cycle is None or bool(cycle.response_complete) or bool(cycle.more_body)


def _receiving(protocol: H11Protocol) -> bool:
    """Part of a request has arrived, not all of it: h11 holds part of a request line or headers
    (IDLE), or the body is still to come (SEND_BODY), whatever was answered meanwhile."""
    return protocol.conn.their_state in (h11.IDLE, h11.SEND_BODY)


def bounded_protocol(cap: int, first_byte_s: float = FIRST_BYTE_S,
                     request_s: float = REQUEST_S) -> type[H11Protocol]:
    """uvicorn's h11 protocol, holding at most ``cap`` connections (uvicorn.Config's ``http``
    takes a protocol class), each closed when its first byte or a whole request is late. One per
    server: the recency order is the class's own."""
    recency: dict[H11Protocol, None] = {}  # least recently active first

    class BoundedH11Protocol(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None
        _request_timed = False  # the deadline running is a request's, not the first byte's

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            recency[self] = None
            self._arm(first_byte_s, request=False)
            if len(recency) > cap:
                victim = next((p for p in recency if p is not self and _idle(p)), self)
                recency.pop(victim, None)
                victim.transport.abort()  # close() would wait for a client that never reads its answer

        def data_received(self, data: bytes) -> None:
            if self in recency:  # most recently active now
                del recency[self]
                recency[self] = None
            super().data_received(data)
            if self.transport.is_closing():
                self._disarm()
            elif not _receiving(self):
                self._disarm()  # a whole request: being answered (then uvicorn's keep-alive timeout)
            elif not self._request_timed:
                self._arm(request_s, request=True)  # from the request's first byte: no drip extends it

        def connection_lost(self, exc: Exception | None) -> None:
            recency.pop(self, None)
            self._disarm()
            super().connection_lost(exc)

        def _arm(self, seconds: float, *, request: bool) -> None:
            self._disarm()
            self._request_timed = request
            self._deadline = self.loop.call_later(seconds, self._late)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            self._deadline, self._request_timed = None, False

        def _late(self) -> None:
            self._deadline = None
            recency.pop(self, None)
            self.transport.abort()

    return BoundedH11Protocol


def server_options() -> dict[str, Any]:
    """uvicorn.Config's options that bound the connections, for the limit in force now."""
    budget = connection_budget()
    return {"http": bounded_protocol(budget.cap), "backlog": budget.burst}
