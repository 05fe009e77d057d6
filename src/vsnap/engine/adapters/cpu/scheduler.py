"""The CPU engine's scheduler: every running request advances one token per step, in turn.

Contract: ``submit()`` admits a request (or refuses it at once: ``ValueError`` for a request
that cannot fit the context, ``ServerBusy`` when the queue is full) and returns its
``Sequence``; the caller reads tokens as they come (``async for``) or waits for all of them
(``result()``), and calls ``cancel()`` when its client goes away. One loop task, started on the
first submit, sends the worker one step for every running sequence, gives each its token, and
starts again; a cancelled sequence is dropped before the next step, so the worker stops
computing for it within one step.

Why step by step: one pipe call used to generate a whole answer while every other request
waited behind it. Now a short request sent after a long one is admitted at the next step and
finishes first. Why not one batched forward pass: see model.py (bit-identical numbers).
Bounded: at most ``max_running`` sequences share the steps (so each step stays short), at most
``max_waiting`` more wait in arrival order for a slot; beyond that, ``ServerBusy`` (HTTP 503).

The counters in ``SchedulerStats`` are what /metrics shows; ``generated_tokens`` is how a test
sees that the worker stopped for a client that went away.
"""

from __future__ import annotations

import asyncio
import enum
from collections import deque
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable

from .model import Step, check_length

StepFn = Callable[[list[tuple[list[int], int]]], Awaitable[list[Step]]]


class ServerBusy(Exception):
    """Every slot is running and the waiting queue is full: retry later (HTTP 503)."""


class SequenceState(enum.Enum):
    WAITING = "waiting"  # admitted, queued in arrival order for a running slot
    RUNNING = "running"  # holds a slot: one token per step
    FINISHED = "finished"  # produced max_tokens tokens
    CANCELLED = "cancelled"  # its client went away: no further step is computed for it
    FAILED = "failed"  # the worker failed (or the engine shut down): the error goes to the reader


_DONE = object()


@dataclass(eq=False)
class Sequence:
    """One request's generation. Tokens arrive in order through ``stream()`` or ``result()``."""

    prompt_ids: list[int]
    max_tokens: int
    top_k: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[str, float]] = field(default_factory=list)
    state: SequenceState = SequenceState.WAITING
    error: BaseException | None = None
    _updates: asyncio.Queue = field(default_factory=asyncio.Queue, repr=False)
    _on_cancel: Callable[["Sequence"], None] | None = field(default=None, repr=False)

    @property
    def done(self) -> bool:
        return self.state in (SequenceState.FINISHED, SequenceState.CANCELLED, SequenceState.FAILED)

    def cancel(self) -> None:
        """The client went away: stop computing for it. Idempotent; no-op once done."""
        if not self.done:
            self.state = SequenceState.CANCELLED
            self._updates.put_nowait(_DONE)
            if self._on_cancel is not None:
                self._on_cancel(self)

    async def stream(self) -> AsyncIterator[Step]:
        """Each (token, top-k logprobs) as it is computed; raises the worker's error, if any."""
        while True:
            item = await self._updates.get()
            if item is _DONE:
                if self.error is not None:
                    raise self.error
                return
            yield item

    async def result(self) -> "Sequence":
        async for _ in self.stream():
            pass
        return self

    # the scheduler's side
    def _emit(self, token: int, top: dict[str, float]) -> None:
        self.token_ids.append(token)
        self.logprobs.append(top)
        self._updates.put_nowait((token, top))
        if len(self.token_ids) == self.max_tokens:
            self.state = SequenceState.FINISHED
            self._updates.put_nowait(_DONE)

    def _fail(self, error: BaseException) -> None:
        if not self.done:
            self.state, self.error = SequenceState.FAILED, error
            self._updates.put_nowait(_DONE)


@dataclass
class SchedulerStats:
    steps: int = 0  # worker calls (one token for each sequence running at the time)
    generated_tokens: int = 0  # tokens the worker computed, a cancelled sequence's last one included
    finished: int = 0
    cancelled: int = 0
    rejected: int = 0  # refused with ServerBusy
    failed: int = 0
    running: int = 0
    waiting: int = 0


class Scheduler:
    def __init__(self, step: StepFn, *, max_len: int, max_running: int = 8, max_waiting: int = 64) -> None:
        if max_running < 1 or max_waiting < 0:
            raise ValueError("max_running must be at least 1 and max_waiting at least 0")
        self._step = step
        self.max_len, self.max_running, self.max_waiting = max_len, max_running, max_waiting
        self.stats = SchedulerStats()
        self._running: list[Sequence] = []
        self._waiting: deque[Sequence] = deque()
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closed: BaseException | None = None

    def submit(self, prompt_ids: list[int], max_tokens: int, top_k: int) -> Sequence:
        """Admit a request; ValueError if it cannot fit max_len, ServerBusy if the queue is full."""
        if max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        check_length(len(prompt_ids), max_tokens, self.max_len)
        if self._closed is not None:
            raise ServerBusy(f"the engine is stopping ({self._closed})")
        if len(self._running) >= self.max_running and len(self._waiting) >= self.max_waiting:
            self.stats.rejected += 1
            raise ServerBusy(f"server busy: {len(self._running)} requests running and {len(self._waiting)} "
                             "waiting; retry later")
        sequence = Sequence(list(prompt_ids), max_tokens, top_k, _on_cancel=self._cancelled)
        self._waiting.append(sequence)
        self._update_gauges()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="vsnap-cpu-scheduler")
        self._wakeup.set()
        return sequence

    def _cancelled(self, sequence: Sequence) -> None:
        self.stats.cancelled += 1
        self._wakeup.set()

    def _update_gauges(self) -> None:
        self.stats.running, self.stats.waiting = len(self._running), len(self._waiting)

    def _admit(self) -> None:
        self._running = [s for s in self._running if not s.done]
        self._waiting = deque(s for s in self._waiting if not s.done)
        while self._waiting and len(self._running) < self.max_running:
            sequence = self._waiting.popleft()
            sequence.state = SequenceState.RUNNING
            self._running.append(sequence)
        self._update_gauges()

    async def _loop(self) -> None:
        while True:
            self._admit()
            if not self._running:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            batch = list(self._running)
            try:
                results = await self._step([(s.prompt_ids + s.token_ids, s.top_k) for s in batch])
            except Exception as error:  # the worker failed: every sequence of this step gets the error
                for sequence in batch:
                    if not sequence.done:
                        self.stats.failed += 1
                    sequence._fail(error)
                continue
            self.stats.steps += 1
            self.stats.generated_tokens += len(results)
            for sequence, (token, top) in zip(batch, results):
                if sequence.done:  # cancelled while the step ran: its token is dropped
                    continue
                sequence._emit(token, top)
                if sequence.done:
                    self.stats.finished += 1

    async def close(self, error: BaseException) -> None:
        """Stop the loop; every request not yet done fails with ``error`` (the engine is stopping)."""
        self._closed = error
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
        for sequence in [*self._running, *self._waiting]:
            if not sequence.done:
                self.stats.failed += 1
            sequence._fail(error)
        self._running, self._waiting = [], deque()
        self._update_gauges()
