"""Progress events and phase timings: the library reports, only the CLI draws."""

from __future__ import annotations

import os
import signal
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Literal


@dataclass(frozen=True)
class PhaseEvent:
    phase: str
    state: Literal["start", "done", "failed"]
    seconds: float | None = None


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

    def add(self, name: str, seconds: float) -> None:
        """Record a phase measured elsewhere (for example inside the engine tree)."""
        self.seconds[name] = seconds

    @property
    def total(self) -> float:
        return time.monotonic() - self._start
