"""The CUDA driver started before the restore's imports: `vsnap restore` and `vsnap activate` call
start() first thing, so the driver's start (cuInit, ~0.07 s on an H200 host) runs on a thread of its
own while the interpreter imports the restore path, and the verify phase takes the GPUs' facts
from facts() instead of asking the driver again. Nothing is decided here: a failure (no GPU, no
cuda-bindings) is kept in the future and raised only where the facts are needed.

On a host with an NVIDIA driver this starts the driver in every restore command, also one of an
image without CUDA state (the command then holds /dev/nvidiactl open, as a CUDA image's restore
always did); the image is not read before the imports, so which it is is not known yet."""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future
from typing import Any

NVIDIA_CONTROL = "/dev/nvidiactl"  # no NVIDIA driver, nothing to start

_facts: Future[tuple[str | None, str, list[dict[str, Any]]]] | None = None
_lock = threading.Lock()


def start() -> None:
    """Start reading the GPUs' facts (_cuda.gpu_facts) on a daemon thread, once per process."""
    global _facts
    with _lock:
        if _facts is not None or not os.path.exists(NVIDIA_CONTROL):
            return
        _facts = future = Future()
    try:
        threading.Thread(target=_read, args=(future,), name="vsnap-gpu-facts", daemon=True).start()
    except BaseException as exc:  # no thread (RuntimeError: can't start new thread): never left pending
        future.set_exception(exc)


def facts() -> Future[tuple[str | None, str, list[dict[str, Any]]]] | None:
    """The facts start() is reading, or None if it was not called (or there is no NVIDIA driver)."""
    return _facts


def _read(future: Future[tuple[str | None, str, list[dict[str, Any]]]]) -> None:
    try:
        from ._cuda import gpu_facts

        future.set_result(gpu_facts())
    except BaseException as exc:  # kept for whoever needs the facts
        future.set_exception(exc)
