"""The three verbs the launcher drives, whatever the engine."""

from __future__ import annotations

import abc
import socket
from typing import Any

from vsnap.protocol.control import Activation, LaunchConfig
from vsnap.protocol.oracle import Oracle


class EngineAdapter(abc.ABC):
    """prepare() before the capture barrier, recover() after activation, then serve()."""

    def __init__(self, launch: LaunchConfig) -> None:
        self.launch = launch

    @abc.abstractmethod
    async def build(self) -> None:
        """Start the engine: load weights, warm up, spawn workers."""

    @abc.abstractmethod
    async def prepare(self) -> Oracle:
        """Compute the oracle, then release what can be rebuilt (weights, caches)."""

    @abc.abstractmethod
    async def recover(self, activation: Activation) -> dict[str, Any]:
        """Re-acquire memory and reload weights; return timings. The launcher re-runs the oracle."""

    @abc.abstractmethod
    async def run_oracle(self) -> Oracle:
        """Greedy outputs with top-k logprobs for the launch's oracle prompts, one request at a time."""

    @abc.abstractmethod
    async def serve(self, sock: socket.socket) -> None:
        """Serve the OpenAI-compatible API on an already bound socket until told to stop."""

    @abc.abstractmethod
    async def shutdown(self) -> None:
        """Stop workers; idempotent."""

