"""The CPU engine's worker process: holds the model, answers requests over a multiprocessing pipe.

It is spawned (not forked) by the frontend, like vLLM's EngineCore. Requests are tuples
``(verb, *args)``; replies are ``("ok", value)`` or ``("error", type, message)``. The verbs:
``ping``; ``step(batch)`` with ``batch`` a list of ``(token ids, top_k)``, answered with one
``(token, top-k logprobs)`` per entry (model.step); ``drop_weights``, ``load_weights``; ``exit``.

Why the worker keeps no per-request state: the frontend sends each sequence's ids with every
step, so a request that is cancelled, fails or outlives a capture leaves nothing behind here,
and the image never holds a half-done request. The ids of a sequence are a few kilobytes at
most; the forward pass costs far more than sending them.
"""

from __future__ import annotations

from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any


def serve_pipe(conn: Connection, model_dir: str, loaded: Any) -> None:
    import torch

    from . import model as cpu_model  # torch's: only the spawned worker loads it, never the frontend

    # One thread: the same arithmetic order on every run, and fewer threads to checkpoint.
    torch.set_num_threads(1)
    directory = Path(model_dir)
    model = cpu_model.TinyDecoder(cpu_model.read_config(directory)).eval()
    cpu_model.load_weights(model, directory)
    loaded.set()  # a multiprocessing.Event: a POSIX semaphore, as vLLM's processes hold too
    handlers: dict[str, Any] = {
        "ping": lambda: "pong",
        "step": lambda batch: cpu_model.step(model, batch),
        "drop_weights": lambda: cpu_model.drop_weights(model),
        "load_weights": lambda: cpu_model.load_weights(model, directory),
    }
    while True:
        try:
            verb, *args = conn.recv()
        except EOFError:
            return
        if verb == "exit":
            conn.send(("ok", None))
            return
        try:
            conn.send(("ok", handlers[verb](*args)))
        except Exception as exc:  # reported to the frontend, which decides
            conn.send(("error", type(exc).__name__, str(exc)))
