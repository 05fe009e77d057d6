"""The CUDA driver started before the restore's imports: `vsnap restore` and `vsnap activate` call
start() first thing, so the driver's start (cuInit, ~0.07 s on an H200 host) runs on a thread of its
own while the interpreter imports the restore path, and the verify phase takes the GPUs' facts
from gpu_facts() instead of asking the driver again. Nothing is decided here: a failure (no GPU, no
cuda-bindings) is kept in the future and raised only where the facts are needed.

On a host with an NVIDIA driver this starts the driver in every restore command, also one of an
image without CUDA state (the command then holds /dev/nvidiactl open, as a CUDA image's restore
always did); the image is not read before the imports, so which it is is not known yet."""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from vsnap.protocol.errors import HostNotReady

from . import cuda

NVIDIA_CONTROL = "/dev/nvidiactl"  # no NVIDIA driver, nothing to start
TIMEOUT_S = 120.0  # cuInit and the device queries (hosts with many GPUs take seconds)

_facts: Future[tuple[str | None, str, list[dict[str, Any]]]] | None = None
_lock = threading.Lock()


def start() -> None:
    """Start reading the GPUs' facts (host.cuda.gpu_facts) on a daemon thread, once per process."""
    global _facts
    with _lock:
        if _facts is not None or not os.path.exists(NVIDIA_CONTROL):
            return
        _facts = future = Future()
    try:
        threading.Thread(target=_read, args=(future,), name="vsnap-gpu-facts", daemon=True).start()
    except BaseException as exc:  # no thread (RuntimeError: can't start new thread): never left pending
        future.set_exception(exc)


def gpu_facts() -> tuple[str | None, str, list[dict[str, Any]]]:
    """The GPUs' facts: those start() began reading, else read now (host.cuda.gpu_facts)."""
    early = _facts
    if early is None:
        return cuda.gpu_facts()
    try:
        return early.result(timeout=TIMEOUT_S)
    except FutureTimeout:  # (not the builtin TimeoutError before Python 3.11)
        raise HostNotReady("cuda", f"the CUDA driver did not start within {TIMEOUT_S:.0f} s",
                           hint="check `nvidia-smi`; a GPU may be hung") from None


def _read(future: Future[tuple[str | None, str, list[dict[str, Any]]]]) -> None:
    try:
        future.set_result(cuda.gpu_facts())
    except BaseException as exc:  # kept for whoever needs the facts
        future.set_exception(exc)
