"""The CPU engine's server holds fewer client connections than it has descriptors.

A restored tree's root is the server: the same descriptor table holds its clients' connections,
the files of its control directory (the owner watchdog reads owner.json every second), its log and
its worker pipe. Idle connections cost a client nothing, and uvicorn keeps one that never sends a
byte forever: 20,200 of them (100 under `ulimit -n 64`) used up every descriptor (hostile pass 12).

So the server keeps at most ``cap`` connections, below its RLIMIT_NOFILE with room to spare for
its own files and for one burst of accepts (asyncio accepts up to ``backlog`` connections per
turn of the loop before any of them is counted). A connection beyond the cap closes the one that
has been idle longest (no request being answered: never sent a byte, sent half a request line, or
waiting between keep-alive requests), so a flood of idle connections cannot lock new clients out;
when every connection is answering a request, the newcomer is closed instead. uvicorn's
``limit_concurrency`` does not bound descriptors (it accepts, then answers 503) and would refuse
everyone once idle clients hold the count (hostile pass 2).
"""

from __future__ import annotations

import asyncio
import os
import resource
from dataclasses import dataclass
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

MAX_CONNECTIONS = 4096  # far more than the engine answers at once (8 running, 64 waiting)
MAX_BURST = 128


@dataclass(frozen=True)
class ConnectionBudget:
    cap: int  # client connections held at most
    burst: int  # the listen backlog, and so the most accepted in one turn of the event loop


def connection_budget(limit: int | None = None, open_now: int | None = None) -> ConnectionBudget:
    """What the server may hold, from its descriptor limit and the descriptors open now: an
    eighth of the rest (at least 16) stays for the tree's own files, another eighth (at most
    MAX_BURST) for a burst of accepts."""
    if limit is None:
        limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if open_now is None:
        open_now = len(os.listdir("/proc/self/fd"))
    headroom = max(limit - open_now, 0)
    reserve = max(16, headroom // 8)
    burst = max(1, min(MAX_BURST, headroom // 8))
    return ConnectionBudget(cap=max(1, min(MAX_CONNECTIONS, headroom - reserve - burst)), burst=burst)


def _idle(protocol: H11Protocol) -> bool:
    """Answering no request: no cycle yet (nothing or half a request line received), or its
    response is complete (a keep-alive connection between requests)."""
    cycle = protocol.cycle
    return cycle is None or bool(cycle.response_complete)


def bounded_protocol(cap: int) -> type[H11Protocol]:
    """uvicorn's h11 protocol, holding at most ``cap`` connections (uvicorn.Config's ``http``
    takes a protocol class). One per server: the recency order is the class's own."""
    recency: dict[H11Protocol, None] = {}  # least recently active first

    class BoundedH11Protocol(H11Protocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            recency[self] = None
            if len(recency) > cap:
                victim = next((p for p in recency if p is not self and _idle(p)), self)
                recency.pop(victim, None)
                victim.transport.close()

        def data_received(self, data: bytes) -> None:
            if self in recency:  # most recently active now
                del recency[self]
                recency[self] = None
            super().data_received(data)

        def connection_lost(self, exc: Exception | None) -> None:
            recency.pop(self, None)
            super().connection_lost(exc)

    return BoundedH11Protocol


def server_options() -> dict[str, Any]:
    """uvicorn.Config's options that bound the connections, for the limit in force now."""
    budget = connection_budget()
    return {"http": bounded_protocol(budget.cap), "backlog": budget.burst}
