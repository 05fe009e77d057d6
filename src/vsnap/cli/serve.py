"""vsnap serve SPEC: the container entrypoint (restore, else cold; serve until SIGTERM)"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import typer

from . import _app as app
from . import _render, error_boundary

if TYPE_CHECKING:
    from vsnap.host.events import PhaseEvent
    from vsnap.ops.serve import Ready


class _Terminated(BaseException):
    """SIGTERM: the orchestrator ends the pod; a clean stop, exit 0. A BaseException, as
    KeyboardInterrupt is: no ``except Exception`` on the way may take it for a failure."""


_stopping: list[int] = []  # the SIGTERM, once received


def _terminate(signum: int, frame: Any) -> None:
    # once: a second SIGTERM (a shell or `timeout` signalling the group too) must not cut the stop short
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _stopping.append(signum)
    raise _Terminated


def _still_stopping() -> None:
    """Raise the stop again if it was taken for a failure on the way (a cleanup that keeps going
    when interrupted adds the stop to the failure as a note, and serving would then fall back to a
    cold start): checked at every event."""
    if _stopping:
        raise _Terminated


def emit(event: str, **detail: Any) -> None:
    """One JSON line on stdout per event, for log collectors (progress stays on stderr)."""
    line = {"format_version": _render.JSON_FORMAT_VERSION, "kind": "serve", "event": event, "time": time.time(),
            **detail}
    sys.stdout.write(json.dumps(line, default=str) + "\n")
    sys.stdout.flush()


@app.command(help="The container entrypoint: restore SPEC's image when this host can take it, else start its "
                  "server cold with the same arguments (after capturing it, with --capture) and say why; serve "
                  "on --host/--port until SIGTERM (a clean stop, exit 0). One JSON line per event on stdout.")
@error_boundary
def serve(
    spec: Path = typer.Argument(..., help="model.yaml"),
    host: str = typer.Option("127.0.0.1", "--host", help="address to serve on"),
    port: int = typer.Option(8000, "--port", min=0, max=65535, help="port to serve on (0: any free port)"),
    gpu: Optional[str] = typer.Option(None, "--gpu", help="GPU index or UUID for a restore (as vsnap restore)"),
    capture: bool = typer.Option(False, "--capture", help="when the image cannot be restored: capture it first, "
                                                          "then restore it (the next start is fast)"),
    ready_file: Optional[Path] = typer.Option(None, "--ready-file", help="written once the first request is fast "
                                              "(restored: the oracle passed; cold: a first completion "
                                              "succeeded), removed at the stop: for a readiness probe; one "
                                              "left by a killed vsnap serve is removed at the start"),
) -> None:
    # First, before the imports: from here on a SIGTERM is a clean stop (exit 0), and one that
    # arrived while SIGTERM was blocked (a parent's signal mask is inherited) is taken now
    signal.signal(signal.SIGTERM, _terminate)
    _stopping.clear()
    try:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        _serve(spec, host, port, gpu, capture, ready_file)
    except _Terminated:
        emit("stopped", reason="SIGTERM")
        # Everything serve made is released by now. Exit here, not through the interpreter's exit:
        # that would wait for the threads an interrupted verify phase left hashing the image (no
        # deadline: minutes for a large image), past the pod's grace period.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _serve(spec: Path, host: str, port: int, gpu: str | None, capture: bool, ready_file: Path | None) -> None:
    # here, not at import: every vsnap command loads every command module
    from vsnap.ops.serve import ReadyFile, serve_spec
    from vsnap.spec.schema import load_spec

    model_spec = load_spec(spec)
    ready = ReadyFile.claim(ready_file) if ready_file is not None else None  # before anything could be ready

    def on_event(event: PhaseEvent) -> None:
        if event.state != "progress":  # one event per phase for log collectors, not a byte count
            emit("phase", phase=event.phase, state=event.state, seconds=event.seconds)
        _still_stopping()

    def on_note(kind: str, detail: dict[str, object]) -> None:
        _still_stopping()  # before: a stop is no reason to capture or fall back
        emit(kind, **detail)

    def on_ready(served: Ready) -> None:
        if ready is not None:
            ready.write(served.url)
        emit("ready", how=served.how, url=served.url, port=served.port, pid=served.pid, fallback=served.fallback)

    emit("start", spec=str(spec), image=str(model_spec.image_dir), capture=capture)
    try:
        serve_spec(model_spec, host=host, port=port, gpu=gpu, capture=capture, on_event=on_event,
                   on_note=on_note, on_ready=on_ready)
    finally:
        if ready is not None:
            ready.remove()  # only the file this process wrote (a link there is removed, not followed)
