"""The built-in CPU engine: a small real engine for machines without a GPU (CI, ``make demo-builtin``).

The same process shape as vLLM, so that a capture and restore exercise what a vLLM tree has:

    adapter.py    the frontend side the launcher drives (build, prepare, recover, serve), the IPC
    scheduler.py  step-wise generation: running requests take turns, bounded queue, cancellation
    server.py     the OpenAI-style HTTP API (completions, chat, streaming, /metrics)
    worker.py     the spawned worker process that holds the model
    model.py      the byte-level transformer in safetensors, greedy steps, chat template

Only ``CpuAdapter`` is public; it is loaded on first use (PEP 562), so the orchestrator can
import ``model`` (to write the default model) without the adapter.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CpuAdapter"]


def __getattr__(name: str) -> Any:
    if name == "CpuAdapter":
        from .adapter import CpuAdapter

        return CpuAdapter
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
