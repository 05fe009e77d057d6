"""`vsnap serve SPEC`: the container entrypoint. It always serves.

If the spec's image exists and this host can take it, it is restored (the oracle proves it before
the port is bound). If not (no image, a host fact that differs, a restore that failed), the spec's
server starts cold with the same arguments, after a capture when ``capture`` is set (so that the
next start is fast), and the one-line reason is reported. Then it serves until told to stop.

Readiness means the first request is fast: a restored instance is ready once it serves (its oracle
passed before the port was bound), a cold one once a first completion through the port succeeded.
The caller learns it through ``on_ready``; `vsnap serve --ready-file` turns it into a file a
readiness probe tests. Every phase is reported through ``on_event`` and every decision through
``on_note`` (the CLI writes one JSON line per event for log collectors).
"""

from __future__ import annotations

import json
import time
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Callable, Literal

from vsnap.host.cleanup import Cleanup
from vsnap.host.events import ProgressCallback, Timings
from vsnap.host.http import server_url
from vsnap.host.metrics import remove_instance_metrics, write_instance_metrics
from vsnap.host.proctree import ProcessIdentity, wait_gone
from vsnap.image.manifest import MANIFEST
from vsnap.protocol.errors import EngineError, VsnapError
from vsnap.spec.schema import ModelSpec

from .bringup import RestoredServer, handed_over_listener
from .capture import capture_image
from .restore import restore_image
from .stop import stop_server
from .tree import boot_tree, launch_config, new_tree_instance, resolve_model

FIRST_COMPLETION_TIMEOUT_S = 120.0
NoteCallback = Callable[[str, dict[str, object]], None]


@dataclass(frozen=True)
class Ready:
    """What serves: ``how`` it came up, where, and why not from the image (``fallback``)."""

    how: Literal["restored", "cold"]
    url: str
    port: int
    pid: int
    fallback: str | None = None  # the one-line reason a restore was not used


def serve_spec(spec: ModelSpec, *, host: str = "127.0.0.1", port: int = 8000, gpu: str | None = None,
               capture: bool = False, on_event: ProgressCallback | None = None,
               on_note: NoteCallback | None = None, on_ready: Callable[[Ready], None] | None = None) -> Ready:
    """Serve ``spec`` on host:port (restored, else cold) until the server exits or the caller is
    interrupted (KeyboardInterrupt, or an exception from a signal handler): then it is stopped,
    everything it made released, and the reason re-raised. Returns once a server that was serving
    exits by itself (EngineError: it ended without being asked)."""
    note = on_note or (lambda _kind, _detail: None)
    reason = _restore_refusal(spec)
    server = _try_restore(spec, host, port, gpu, on_event) if reason is None else None
    if isinstance(server, str):
        reason, server = server, None
    if server is None and capture:
        note("capture", {"reason": reason})
        try:
            capture_image(spec, image_dir=spec.image_dir, force=True, on_event=on_event)
        except VsnapError as error:
            reason = f"{reason}; the capture failed: {error.message}"
        else:
            server = _try_restore(spec, host, port, gpu, on_event)
            if isinstance(server, str):
                reason, server = f"{reason}; after the capture, {server}", None
    if server is not None:
        return _serve_restored(server, on_ready)
    note("fallback", {"reason": reason})
    return _serve_cold(spec, host, port, gpu, str(reason), on_event, on_ready)


def _try_restore(spec: ModelSpec, host: str, port: int, gpu: str | None,
                 on_event: ProgressCallback | None) -> RestoredServer | str:
    """The spec's image restored and serving, or the one-line reason it is not (the restore
    released everything it made)."""
    try:
        return restore_image(spec.image_dir, host=host, port=port, gpu=gpu, on_event=on_event)
    except VsnapError as error:
        return f"the restore failed: {error.message}"


def _restore_refusal(spec: ModelSpec) -> str | None:
    """Why the spec's image cannot be restored here without trying (None: try it). Only its
    absence is known this early; what else stops a restore (a host fact, the files) the restore's
    own verify phase says, before CRIU runs."""
    if not (spec.image_dir / MANIFEST).exists():
        return f"no image at {spec.image_dir}"
    return None


def _serve_restored(server: RestoredServer, on_ready: Callable[[Ready], None] | None) -> Ready:
    ready = Ready("restored", server.url, server.port, server.pid)
    try:
        if on_ready is not None:
            on_ready(ready)
        _wait_exit(server.identity, server.pid)
    finally:
        stop_server(server)  # also after the tree ended by itself: its record and directories go
    raise EngineError("serve", "EngineExited", "the restored server exited without being asked",
                      log_path=str(server.engine_log))


def _serve_cold(spec: ModelSpec, host: str, port: int, gpu: str | None, reason: str,
                on_event: ProgressCallback | None, on_ready: Callable[[Ready], None] | None) -> Ready:
    """The spec's server started cold in a tree of its own (serve mode: no capture barrier), the
    port handed over once it validated, ready after a first completion through that port. ``gpu``
    (what --gpu would give a restore) becomes the tree's CUDA_VISIBLE_DEVICES."""
    timings = Timings(on_event)
    with Cleanup() as cleanup, ExitStack() as serving:
        instance = new_tree_instance(spec.control_dir, "cold", cleanup)
        booted = boot_tree(spec.control_dir, instance, launch_config(spec, resolve_model(spec), mode="serve"),
                           cleanup, env={"CUDA_VISIBLE_DEVICES": gpu} if gpu else None, timings=timings)
        identity = booted.tree.identity
        bound = serving.enter_context(handed_over_listener(instance.work, identity, host, port, booted.log))
        url = server_url(host, bound)
        with timings.phase("first completion"):
            first_completion(url, spec.served_model_name)
        ready = Ready("cold", url, bound, identity.pid, reason)
        write_instance_metrics(instance.id, spec.name, "cold", timings.seconds, fallback=True)
        cleanup.on_exit(remove_instance_metrics, instance.id)
        if on_ready is not None:
            on_ready(ready)
        _wait_exit(identity, identity.pid)
    raise EngineError("serve", "EngineExited", "the cold server exited without being asked",
                      log_path=str(booted.log))


def _wait_exit(identity: ProcessIdentity | None, pid: int) -> None:
    """Until the tree's root exits (a pidfd: no polling, and a reused PID is never waited on)."""
    wait_gone([identity if identity is not None else pid], None)


def first_completion(url: str, model: str, timeout_s: float = FIRST_COMPLETION_TIMEOUT_S) -> None:
    """One greedy one-token completion through the served port (EngineError if it fails)."""
    import urllib.request  # 12 to 19 ms of a command's start (host/http.py): only a cold start pays it

    body = json.dumps({"model": model, "prompt": "Hello", "max_tokens": 1, "temperature": 0}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"content-type": "application/json"})
    started = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            choices = json.load(response).get("choices")
    except (OSError, ValueError) as exc:  # URLError and HTTPError are OSErrors
        raise EngineError("serve", "FirstCompletionFailed", f"POST {url}/v1/completions failed after "
                          f"{time.monotonic() - started:.1f} s: {exc}") from None
    if not choices:
        raise EngineError("serve", "FirstCompletionFailed", f"POST {url}/v1/completions answered no choice")
