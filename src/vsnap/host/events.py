"""Progress events and phase timings: the library reports, only the CLI draws."""

from __future__ import annotations

import os
import signal
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Literal


@dataclass(frozen=True)
class PhaseEvent:
    phase: str
    state: Literal["start", "done", "failed", "progress"]
    seconds: float | None = None
    done_bytes: int | None = None   # "progress": how far a long phase (a push's or pull's transfer) is
    total_bytes: int | None = None


ProgressCallback = Callable[[PhaseEvent], None]


FAILPOINT_ENV = "VSNAP_FAILPOINT"


STALL_S = 3.0


def failpoint(name: str) -> None:
    """Fault injection for the fault tests: VSNAP_FAILPOINT="criu dump" SIGKILLs this process at the
    start of that phase, "after criu dump" at its end; "stall recover" waits STALL_S there (so a
    test can act on a run in flight). Unset in normal use."""
    wanted = os.environ.get(FAILPOINT_ENV)
    if wanted == name:
        os.kill(os.getpid(), signal.SIGKILL)
    elif wanted == f"stall {name}":
        time.sleep(STALL_S)


def _ignore(_: PhaseEvent) -> None:
    pass


class Timings:
    """Ordered phase durations, fed by ``with timings.phase(name):``."""

    def __init__(self, on_event: ProgressCallback | None = None) -> None:
        self.seconds: dict[str, float] = {}
        self._on_event = on_event or _ignore
        self._start = time.monotonic()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        failpoint(name)
        self._on_event(PhaseEvent(name, "start"))
        start = time.monotonic()
        try:
            yield
        except BaseException:
            self.seconds[name] = time.monotonic() - start
            self._on_event(PhaseEvent(name, "failed", self.seconds[name]))
            raise
        self.seconds[name] = time.monotonic() - start
        self._on_event(PhaseEvent(name, "done", self.seconds[name]))
        failpoint(f"after {name}")

    def progress(self, name: str, total_bytes: int | None = None) -> "ByteProgress":
        """A counter for phase ``name`` (running) that reports its bytes at most every
        ByteProgress.EVERY_S, from any thread (``total_bytes``: what it expects, if known)."""
        return ByteProgress(name, total_bytes, self._on_event)

    def add(self, name: str, seconds: float) -> None:
        """Record a phase measured elsewhere (for example inside the engine tree)."""
        self.seconds[name] = seconds

    @property
    def total(self) -> float:
        return time.monotonic() - self._start


class ByteProgress:
    """Bytes moved in one long phase, counted from any thread; a "progress" PhaseEvent at most
    every EVERY_S (the caller's callback draws it: a rate and a remaining size on a terminal)."""

    EVERY_S = 0.5

    def __init__(self, phase: str, total_bytes: int | None, on_event: ProgressCallback) -> None:
        self.phase, self.total_bytes, self._on_event = phase, total_bytes, on_event
        self.done_bytes = 0
        self._lock = threading.Lock()
        self._reported_at = time.monotonic()
        self._failed = False

    def expect(self, nbytes: int) -> None:
        """More bytes to come than announced (a pull learns what it must fetch file set by file set)."""
        with self._lock:
            self.total_bytes = (self.total_bytes or 0) + nbytes

    def add(self, nbytes: int) -> None:
        """Count ``nbytes`` (from the transfer thread that moved them). The report never fails the
        transfer: a callback that raises (stderr's reader gone) is not called again."""
        with self._lock:
            self.done_bytes += nbytes
            now = time.monotonic()
            if self._failed or now - self._reported_at < self.EVERY_S:
                return
            self._reported_at = now
            event = PhaseEvent(self.phase, "progress", None, self.done_bytes, self.total_bytes)
        try:
            self._on_event(event)
        except Exception:  # only a display: the bytes still count, the download goes on
            self._failed = True
