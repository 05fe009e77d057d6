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


class _Terminated(Exception):
    """SIGTERM: the orchestrator ends the pod; a clean stop, exit 0."""


def _terminate(signum: int, frame: Any) -> None:
    # once: a second SIGTERM (a shell or `timeout` signalling the group too) must not cut the stop short
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
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
                                              "succeeded), removed at the stop: for a readiness probe"),
) -> None:
    # here, not at import: every vsnap command loads every command module
    from vsnap.host.trust import make_trusted_dirs
    from vsnap.ops.serve import serve_spec
    from vsnap.protocol.control import write_atomic
    from vsnap.spec.schema import load_spec

    signal.signal(signal.SIGTERM, _terminate)  # after error_boundary's: a stop, not an interruption
    model_spec = load_spec(spec)
    ready_path = Path(os.path.abspath(ready_file)) if ready_file is not None else None
    written: list[Path] = []  # the ready file, once vsnap wrote it: only that is removed at the stop

    def on_event(event: PhaseEvent) -> None:
        emit("phase", phase=event.phase, state=event.state, seconds=event.seconds)

    def on_ready(ready: Ready) -> None:
        if ready_path is not None:  # every directory on the way root's alone, the file never through a link
            directory = make_trusted_dirs(ready_path.parent)
            write_atomic(directory, ready_path.name, f"{ready.url}\n".encode())
            written.append(directory / ready_path.name)
        emit("ready", how=ready.how, url=ready.url, port=ready.port, pid=ready.pid, fallback=ready.fallback)

    emit("start", spec=str(spec), image=str(model_spec.image_dir), capture=capture)
    try:
        serve_spec(model_spec, host=host, port=port, gpu=gpu, capture=capture, on_event=on_event,
                   on_note=lambda kind, detail: emit(kind, **detail), on_ready=on_ready)
    except _Terminated:
        emit("stopped", reason="SIGTERM")
    finally:
        for path in written:  # never a file vsnap did not write (a refused path is left alone)
            try:
                os.unlink(path)  # a link there is removed, not followed
            except FileNotFoundError:
                pass
