"""`vsnap serve SPEC`: the container entrypoint. It always serves.

If the spec's image exists and this host can take it, it is restored (the oracle proves it before
the port is bound). If not (no image, a host fact that differs, a restore that failed), the spec's
server starts cold with the same arguments, after a capture when ``capture`` is set (so that the
next start is fast), and the one-line reason is reported. Then it serves until told to stop.

A port that cannot be bound is refused before anything starts (a cold start could not bind it
either). Either way the instance has a record from its start (host.instances), so `vsnap ps` and
`vsnap stop` see it, and its metrics file goes with it.

Readiness means the first request is fast: a restored instance is ready once it serves (its oracle
passed before the port was bound), a cold one once a first completion through the port succeeded.
The caller learns it through ``on_ready``; `vsnap serve --ready-file` turns it into a file a
readiness probe tests (ReadyFile). Every phase is reported through ``on_event`` and every decision
through ``on_note`` (the CLI writes one JSON line per event for log collectors).
"""

from __future__ import annotations

import os
import re
import stat
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal

from vsnap.host.cleanup import Cleanup
from vsnap.host.events import ProgressCallback, Timings
from vsnap.host.http import check_port_free, server_url
from vsnap.host.instances import InstanceRecord, ProcessRef, register, this_process, unregister
from vsnap.host.metrics import write_instance_metrics
from vsnap.host.proctree import ProcessIdentity, is_same, wait_gone
from vsnap.host.trust import make_trusted_dirs
from vsnap.image.manifest import MANIFEST
from vsnap.protocol.control import write_atomic
from vsnap.protocol.errors import ControlProtocolError, EngineError, VsnapError
from vsnap.spec.schema import ModelSpec

from .bringup import RestoredServer, check_stop, handed_over_listener
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
    everything it made released, and the reason re-raised. Raises once a server that was serving
    exits by itself (EngineError: it ended without being asked). A port that cannot be bound is
    refused first (HostNotReady), before any restore or cold start."""
    note = on_note or (lambda _kind, _detail: None)
    check_port_free(host, port)
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
    (what --gpu would give a restore) becomes the tree's CUDA_VISIBLE_DEVICES.

    Registered as a restore is: "restoring" (owned by this process) from before the launch, the
    tree named once it validated, "serving" with its metrics directory once ready; a `vsnap stop`
    meanwhile is honoured between phases."""
    from .bench.outputs import first_token  # urllib.request: only a cold start pays its import

    timings = Timings(on_event)
    with Cleanup() as cleanup, ExitStack() as serving:
        instance = new_tree_instance(spec.control_dir, "cold", cleanup)
        record = InstanceRecord(id=instance.id, image=str(spec.image_dir), name=spec.name, state="restoring",
                                owner=this_process(), instance_dir=str(instance.work), started_at=time.time())
        register(record)  # `vsnap ps` and `vsnap stop` see it from now on
        cleanup.on_exit(unregister, instance.id)  # run after the tree's end (registered below); its metrics too
        booted = boot_tree(spec.control_dir, instance, launch_config(spec, resolve_model(spec), mode="serve"),
                           cleanup, env={"CUDA_VISIBLE_DEVICES": gpu} if gpu else None, timings=timings)
        identity = booted.tree.identity
        record = record.model_copy(update={"tree": ProcessRef.of(identity)})
        register(record)
        check_stop(instance.work)
        bound = serving.enter_context(handed_over_listener(instance.work, identity, host, port, booted.log))
        url = server_url(host, bound)
        with timings.phase("first completion"):
            first_token(url, spec.served_model_name, timeout_s=FIRST_COMPLETION_TIMEOUT_S, phase="serve")
        check_stop(instance.work)
        metrics = write_instance_metrics(instance.id, spec.name, "cold", timings.seconds, fallback=True)
        register(record.model_copy(update={"state": "serving", "url": url, "port": bound,
                                           "timings": dict(timings.seconds),
                                           "metrics_dir": str(metrics.parent) if metrics else ""}))
        ready = Ready("cold", url, bound, identity.pid, reason)
        if on_ready is not None:
            on_ready(ready)
        _wait_exit(identity, identity.pid)
    raise EngineError("serve", "EngineExited", "the cold server exited without being asked",
                      log_path=str(booted.log))


def _wait_exit(identity: ProcessIdentity | None, pid: int) -> None:
    """Until the tree's root exits (a pidfd: no polling, and a reused PID is never waited on)."""
    wait_gone([identity if identity is not None else pid], None)


READY_MARK = "vsnap-serve-ready"  # the second line of a ready file, before its writer's identity
READY_MAX_BYTES = 4096
PID_MAX = 1 << 22  # the kernel's largest pid_max
BOOT_ID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")  # /proc/sys/kernel/random/boot_id


def _number(text: str, limit: int) -> bool:
    """ASCII digits of a number from 1 to ``limit`` (str.isdigit() takes '²', which int() refuses)."""
    return text.isascii() and text.isdigit() and 0 < int(text) <= limit


@dataclass(frozen=True)
class ReadyFile:
    """`vsnap serve --ready-file`: written once the first request is fast, removed at the stop; a
    readiness probe tests that it exists.

    Its text is the URL, then ``vsnap-serve-ready PID START_TIME BOOT_ID``: the process that wrote
    it. A vsnap serve that was killed (SIGKILL, the OOM killer) leaves its file, which would make
    the probe pass during the next boot, before that boot's oracle or first completion; claim()
    removes it, but only a file it can prove a vsnap serve wrote (a private regular file of
    root's with one link, exactly those two lines, its writer no longer running). Anything else
    there is refused in one line naming it (ControlProtocolError, exit 8) and left as it is. Never
    through a link: the directories on the way are root's alone (make_trusted_dirs: another user's
    link there is refused, ImageUntrusted), the file is opened without following one."""

    directory: Path
    name: str

    @property
    def path(self) -> Path:
        return self.directory / self.name

    @classmethod
    def claim(cls, path: Path) -> ReadyFile:
        """The ready file at ``path``, any stale one of a vsnap serve's removed (before anything starts)."""
        path = Path(os.path.abspath(path))
        if not path.name:  # "/": no name to write (the write, once serving, raised a bare OSError)
            error = ControlProtocolError(path, "is a directory, not a file path for the ready file")
            error.hint = "give --ready-file the path of a file, e.g. /run/vsnap/ready"
            raise error
        ready = cls(make_trusted_dirs(path.parent), path.name)
        ready._remove_if(lambda writer: not is_same(writer), stale=True)
        return ready

    def write(self, url: str) -> None:
        me = this_process()
        write_atomic(self.directory, self.name, f"{url}\n{READY_MARK} {me.pid} {me.start_time} {me.boot_id}\n".encode())

    def remove(self) -> None:
        """Remove the file if this process wrote it (a file vsnap did not write is left alone)."""
        me = this_process().identity
        try:
            self._remove_if(lambda writer: writer == me, stale=False)
        except (ControlProtocolError, OSError):
            pass  # not ours (any more), or its directory gone: left as it is

    def _remove_if(self, removable: Callable[[ProcessIdentity], bool], *, stale: bool) -> None:
        """Unlink the file if a vsnap serve wrote it and ``removable(its writer)``; absent: nothing.
        With ``stale``, anything else there is refused (ControlProtocolError)."""
        dir_fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            writer = self._writer(dir_fd)
            if writer is None:
                return
            if removable(writer):
                os.unlink(self.name, dir_fd=dir_fd)
            elif stale:
                raise self._refused(f"the ready file of a running vsnap serve (pid {writer.pid})",
                                    "give each vsnap serve its own --ready-file")
        finally:
            os.close(dir_fd)

    def _writer(self, dir_fd: int) -> ProcessIdentity | None:
        """The process that wrote the file (None: there is none), or ControlProtocolError when it
        is not a file vsnap serve wrote."""
        try:
            fd = os.open(self.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
        except FileNotFoundError:
            return None
        except OSError as exc:  # ELOOP: a link, never followed
            raise self._refused(f"cannot be opened without following a link ({exc.strerror})") from None
        try:
            st = os.fstat(fd)
            if (not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077
                    or st.st_nlink != 1 or st.st_size > READY_MAX_BYTES):
                raise self._refused("not a private regular file of root's with one link")
            text = os.read(fd, READY_MAX_BYTES + 1).decode(errors="replace")
        finally:
            os.close(fd)
        lines = text.split("\n")
        fields = lines[1].split(" ") if len(lines) == 3 else []
        if (lines[-1] != "" or not lines[0].startswith(("http://", "https://")) or len(fields) != 4
                or fields[0] != READY_MARK or not _number(fields[1], PID_MAX) or not _number(fields[2], 1 << 64)
                or not BOOT_ID.fullmatch(fields[3])):
            raise self._refused("not a ready file vsnap serve wrote")
        return ProcessIdentity(int(fields[1]), int(fields[2]), fields[3])

    def _refused(self, reason: str, hint: str = "") -> ControlProtocolError:
        error = ControlProtocolError(self.path, f"{reason}; left as it is")
        error.hint = hint or "remove it if nothing else uses it, or give --ready-file a path of its own"
        return error
