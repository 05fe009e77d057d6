"""The control directory: the file protocol between the vsnap CLI and the engine tree.

    launch.json      CLI -> engine   what to build (engine, model, serve args, oracle settings)
    ready.json       engine -> CLI   the capture barrier is reached; carries the oracle
    standby.json     CLI -> engine   this restored tree is a standby: wait for activation.json
                                     as long as it takes (no timeout)
    activation.json  CLI -> engine   the tree was restored: recover, then serve on host:port
    status.json      engine -> CLI   "recovering", then "validated", then "serving"
    error.json       engine -> CLI   phase, type, message of a failure
    owner.json       CLI -> engine   the owning vsnap's heartbeat (or that it handed the tree over)
    activator.json   CLI -> engine   `vsnap activate`'s heartbeat while it activates a standby

Every write is atomic (a temp file opened O_EXCL|O_NOFOLLOW, fsync, rename, fsync of the
directory). Every read refuses symlinks, files that are not regular, files owned by another
user and files others may write. The directory itself must be owned by us and private (0700).

A leaf: imports protocol.records, protocol.errors and protocol.oracle only (the engine tree imports
it; no pydantic: every `vsnap restore` reads these messages before its first phase).
"""

from __future__ import annotations

import errno
import json
import os
import re
import socket
import stat
import struct
import threading
import time
from pathlib import Path
from typing import Any, Callable, Literal, TypeVar

from .errors import ControlProtocolError, PhaseTimeout
from .oracle import Oracle
from .records import Record, RecordError, field, is_plain
from .version import PROTOCOL_VERSION, __version__

LAUNCH = "launch.json"
READY = "ready.json"
ACTIVATION = "activation.json"
STANDBY = "standby.json"
STATUS = "status.json"
ERROR = "error.json"
OWNER = "owner.json"
ACTIVATOR = "activator.json"
LISTENER = "listen.sock"  # where the engine receives its HTTP socket (SCM_RIGHTS) after validation
ENGINE_LOG = "engine.log"
CONTROL_FILES = (READY, ACTIVATION, STANDBY, STATUS, ERROR, OWNER, ACTIVATOR)
# ready.json carries the oracle: at most 131072 log probabilities (model.yaml's bound), ~5 MB
MAX_CONTROL_BYTES = 64 << 20

# The vsnap process that owns a tree (the capture, or a foreground restore) writes owner.json
# every OWNER_BEAT_S; a tree whose owner fell silent for OWNER_TIMEOUT_S shuts itself down, so a
# SIGKILLed vsnap never leaves an engine running. A detached restore hands the tree over.
OWNER_BEAT_S = 0.5
OWNER_TIMEOUT_S = 10.0
# `vsnap activate` beats activator.json the same way from before the CUDA restore until the tree
# serves: a tree whose activator fell silent this long ends itself, and with it the GPU memory its
# CUDA restore took (a standby's owner is often none: `restore --standby --detach`). Shorter than
# the owner's: an activation is minutes at most, and a leaked GPU costs more than a dropped one.
ACTIVATOR_TIMEOUT_S = 5.0
# An open() that fails for these is the process's (or the host's) shortage, not the file's: the
# file is neither gone nor unsafe. Clients of a restored server can exhaust its descriptors.
SHORTAGE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})

# A single sleep never counts for more than this against a timeout: a restored tree's
# CLOCK_MONOTONIC jumps (days may pass between capture and restore, and another host's
# clock starts elsewhere), and such a jump must not expire the wait.
MAX_COUNTED_STEP_S = 1.0



class OutOfResources(ControlProtocolError):
    """A control file could not be opened for want of descriptors or memory (EMFILE, ENFILE, ENOMEM):
    the reader's shortage, which says nothing about the file. A ControlProtocolError still, so
    that every caller that refuses an unusable file refuses this one as before; the tree's
    watchdog alone tells it apart (a flood of clients must not read as a dead owner)."""


class _Message(Record):
    """A control message: frozen, and read only if it has exactly its fields (protocol.records)."""


class _Versioned(_Message):
    """A message that says which contract, and which vsnap, wrote it: build it with ``**stamp()``.
    read_message refuses one of another protocol version, naming both sides."""

    protocol: int
    vsnap: str


def stamp() -> dict[str, Any]:
    """The version fields every versioned message carries."""
    return {"protocol": PROTOCOL_VERSION, "vsnap": __version__}


def _require_protocol(data: bytes, path: Path) -> None:
    try:
        raw = json.loads(data)
    except (ValueError, RecursionError):
        return  # malformed: model validation says so
    if isinstance(raw, dict) and raw.get("protocol") != PROTOCOL_VERSION:
        raise ControlProtocolError(path, f"written by vsnap {raw.get('vsnap', 'older than 0.2')} (protocol "
                                         f"{raw.get('protocol', 1)}); this side is vsnap {__version__} "
                                         f"(protocol {PROTOCOL_VERSION})")


class LaunchConfig(_Versioned):
    """Everything the engine tree needs to build its engine; written once before launch."""

    engine: Literal["cpu", "vllm"]
    model: str
    served_model_name: str
    serve_args: dict[str, Any] = field(default_factory=dict)
    oracle_prompts: list[str]
    oracle_max_tokens: int
    oracle_top_k: int
    oracle_tolerance: float
    timeout_s: float
    # "snapshot": stop at the capture barrier; "serve": a plain cold start (what `vsnap bench` times)
    mode: Literal["snapshot", "serve"] = "snapshot"
    # vLLM: where the engine writes its weights file at capture (a host path; None: reload from the model)
    weights_dir: str | None = None
    # the root installs a seccomp filter that makes io_uring_setup fail (engine/seccomp.py) before
    # anything else runs, so no process of the tree holds an io_uring CRIU cannot dump
    block_io_uring: bool = False


class Ready(_Versioned):
    pid: int
    oracle: Oracle
    times: dict[str, float] = field(default_factory=dict)


class Activation(_Versioned):
    host: str
    port: int = field(ge=0, le=65535)
    weights_dir: str | None = None  # the image's weights file directory, when it has one


class Standby(_Versioned):
    """Written into a standby's instance directory before CRIU restores it: the tree waits for its
    activation without a timeout (its CUDA state stays checkpointed until `vsnap activate`)."""

    since: float  # time.time() when the standby was restored


class Status(_Message):
    state: Literal["recovering", "validated", "serving", "stopped"]
    times: dict[str, float] = field(default_factory=dict)
    detail: dict[str, Any] = field(default_factory=dict)


class Owner(_Message):
    pid: int
    beat: float  # time.time() of the last heartbeat: wall clock, the same on both sides of a restore
    detached: bool = False


class ErrorReport(_Message):
    phase: str
    type: str
    message: str
    detail: dict[str, Any] = field(default_factory=dict)


M = TypeVar("M", bound=_Message)


def ensure_private_dir(path: Path, *, create: bool = True) -> Path:
    """Create ``path`` (0700) if asked, then check it is a private directory we own."""
    if create:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
    check_private_dir(path)
    return path


def check_private_dir(path: Path) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise ControlProtocolError(path, "does not exist") from None
    if stat.S_ISLNK(st.st_mode):
        raise ControlProtocolError(path, "is a symlink; a control directory must be a real directory")
    if not stat.S_ISDIR(st.st_mode):
        raise ControlProtocolError(path, "is not a directory")
    if st.st_uid != os.geteuid():
        raise ControlProtocolError(path, f"is owned by uid {st.st_uid}, not by us (uid {os.geteuid()})")
    if st.st_mode & 0o077:
        raise ControlProtocolError(path, f"has mode {stat.S_IMODE(st.st_mode):04o}; it must be private (0700)")


def write_atomic(directory: Path, name: str, data: bytes, *, durable: bool = True) -> None:
    """Write ``directory/name`` atomically, never following a symlink. ``durable=False`` skips
    the fsyncs (the rename is atomic for readers either way): for heartbeats, which say something
    only while both sides run, and which a slow disk must not delay past a watcher's timeout."""
    try:
        _write_atomic(directory, name, data, durable)
    except OSError as exc:
        if exc.filename is None:  # a write or fsync through a descriptor names no file: name it
            raise OSError(exc.errno, exc.strerror, str(directory / name)) from exc
        raise


def _write_atomic(directory: Path, name: str, data: bytes, durable: bool) -> None:
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        tmp = temp_name(name, os.getpid())
        renamed = False
        try:  # from before the temp file exists to its rename: whatever ends this removes it
            try:
                os.unlink(tmp, dir_fd=dir_fd)
            except FileNotFoundError:
                pass
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=dir_fd)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                if durable:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            renamed = True
        finally:
            # a full disk, a directory planted at ``name``, or a stop's exception landing anywhere in
            # the block (even as os.open or os.close returns): no temp file left (the name holds our
            # pid and was made O_EXCL: it is ours). A signal landing just here is what
            # remove_stale_temp_files is for.
            if not renamed:
                try:
                    os.unlink(tmp, dir_fd=dir_fd)
                except FileNotFoundError:
                    pass
        if durable:
            os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


_TEMP_PREFIX, _TEMP_SUFFIX = ".", ".tmp"


def temp_name(name: str, pid: int) -> str:
    """The temporary name write_atomic writes ``name`` under, in the same directory."""
    return f"{_TEMP_PREFIX}{name}.{pid}{_TEMP_SUFFIX}"


_TEMP_NAME = re.compile(rf"{re.escape(_TEMP_PREFIX)}(.+)\.[0-9]{{1,10}}{re.escape(_TEMP_SUFFIX)}", re.DOTALL)  # temp_name's
STALE_TEMP_S = 60.0  # a write_atomic temp file lives for one write: one this old was left by a killed writer


def remove_stale_temp_files(directory: Path, named: re.Pattern[str], older_than_s: float = STALE_TEMP_S) -> list[str]:
    """Remove from ``directory`` (one of vsnap's own, root's and private) write_atomic's temp files
    of names ``named`` fully matches that a writer killed mid-write left: regular files of ours,
    untouched for ``older_than_s``. Anything else is left where it is. Returns the names removed."""
    removed = []
    try:
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return removed
    try:
        for entry in os.listdir(dir_fd):
            m = _TEMP_NAME.fullmatch(entry)
            if m is None or not named.fullmatch(m.group(1)):
                continue
            try:
                st = os.stat(entry, dir_fd=dir_fd, follow_symlinks=False)
                if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and time.time() - st.st_mtime > older_than_s:
                    os.unlink(entry, dir_fd=dir_fd)
                    removed.append(entry)
            except FileNotFoundError:
                continue
    finally:
        os.close(dir_fd)
    return removed


def write_message(directory: Path, name: str, message: _Message, *, durable: bool = True) -> None:
    write_atomic(directory, name, message.model_dump_json().encode(), durable=durable)


def read_bytes(directory: Path, name: str) -> bytes | None:
    """Read a control file, or None if absent. Refuses symlinks and foreign or shared-writable files."""
    read = _read_file(directory, name)
    return None if read is None else read[0]


def _read_file(directory: Path, name: str) -> tuple[bytes, os.stat_result] | None:
    """read_bytes, with the stat of the very file read (the watchdog keys what it read on its inode)."""
    path = directory / name
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ControlProtocolError(path, "is a symlink; control files are never followed") from None
        if exc.errno in SHORTAGE_ERRNOS:
            raise OutOfResources(path, f"cannot be opened now: {exc.strerror}") from None
        raise ControlProtocolError(path, f"cannot be opened: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ControlProtocolError(path, "is not a regular file")
        if st.st_uid != os.geteuid():
            raise ControlProtocolError(path, f"was written by uid {st.st_uid}, not by us (uid {os.geteuid()})")
        if st.st_mode & 0o022:
            raise ControlProtocolError(path, f"has mode {stat.S_IMODE(st.st_mode):04o}; others could have written it")
        if st.st_size > MAX_CONTROL_BYTES:  # a tree (or whoever wrote it) must not fill root's memory
            raise ControlProtocolError(path, f"holds {st.st_size} bytes; a control file holds at most {MAX_CONTROL_BYTES}")
        chunks, left = [], MAX_CONTROL_BYTES + 1
        while left > 0 and (chunk := os.read(fd, min(1 << 20, left))):
            chunks.append(chunk)
            left -= len(chunk)
        if left <= 0:
            raise ControlProtocolError(path, f"grew past {MAX_CONTROL_BYTES} bytes while it was read")
        return b"".join(chunks), st
    finally:
        os.close(fd)


def read_message(directory: Path, name: str, model: type[M]) -> M | None:
    data = read_bytes(directory, name)
    return None if data is None else _parse(data, directory / name, model)


def _parse(data: bytes, path: Path, model: type[M]) -> M:
    if issubclass(model, _Versioned):
        _require_protocol(data, path)
    try:
        return model.model_validate_json(data)
    except RecordError as exc:
        raise ControlProtocolError(path, f"malformed ({exc.where}: {exc.msg})") from None


def remove_control_files(directory: Path, names: tuple[str, ...] = CONTROL_FILES) -> None:
    """Clear the messages of an earlier run so they are not mistaken for this one's."""
    for name in names:
        try:
            os.unlink(directory / name)
        except FileNotFoundError:
            pass


T = TypeVar("T")


class WaitBudget:
    """A timeout that counts only time really spent waiting.

    Each step between two ticks counts for at most MAX_COUNTED_STEP_S, so a monotonic clock
    that jumps forward (or back) across a checkpoint and restore does not expire the wait.
    """

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.waited = 0.0
        self._last = time.monotonic()

    def tick(self) -> None:
        now = time.monotonic()
        self.waited += min(max(now - self._last, 0.0), MAX_COUNTED_STEP_S)
        self._last = now

    def expired(self) -> bool:
        return self.waited >= self.timeout_s


def wait_until(
    probe: Callable[[], T | None],
    *,
    timeout_s: float,
    phase: str,
    interval_s: float = 0.02,
    log_path: Path | str | None = None,
) -> T:
    """Poll ``probe`` until it returns something other than None, or raise PhaseTimeout."""
    budget = WaitBudget(timeout_s)
    while True:
        result = probe()
        if result is not None:
            return result
        if budget.expired():
            raise PhaseTimeout(phase, timeout_s, log_path=log_path)
        time.sleep(interval_s)
        budget.tick()


class OwnerHeartbeat:
    """Writes a heartbeat (owner.json; ``name=ACTIVATOR`` for `vsnap activate`) every OWNER_BEAT_S
    from a daemon thread until stopped or detached.

    With ``while_alive``, it also stops by itself once that process (the restored tree) is gone.
    The periodic beats skip fsync (``durable=False``): a disk busy with a model's weights could
    otherwise hold a beat for seconds, and a beat only means something while both sides run.
    """

    def __init__(self, control_dir: Path, while_alive: Callable[[], bool] | None = None, *,
                 name: str = OWNER) -> None:
        self.control_dir = control_dir
        self.name = name
        self._while_alive = while_alive
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"vsnap-{name.split('.')[0]}-heartbeat", daemon=True)

    def start(self) -> "OwnerHeartbeat":
        self.beat()
        self._thread.start()
        return self

    def beat(self, detached: bool = False) -> None:
        write_message(self.control_dir, self.name, Owner(pid=os.getpid(), beat=time.time(), detached=detached),
                      durable=detached)

    def _run(self) -> None:
        while not self._stop.wait(OWNER_BEAT_S):
            if self._while_alive is not None and not self._while_alive():
                return
            try:
                self.beat()
            except OSError:
                continue  # a full disk must not read as a dead owner for as long as writes fail

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def detach(self) -> None:
        """Hand the tree over: it keeps running without an owner (or, for an activator, the
        activation is done: the tree serves, and its owner is whoever restored it)."""
        self.stop()
        self.beat(detached=True)

    def __enter__(self) -> "OwnerHeartbeat":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _short_path(directory: Path, name: str) -> tuple[int, str]:
    """An AF_UNIX path for directory/name that fits the 108-byte limit: /proc/self/fd/N/name."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    return fd, f"/proc/self/fd/{fd}/{name}"


def open_handoff(directory: Path) -> socket.socket:
    """Engine side: listen on directory/listen.sock for the HTTP socket."""
    fd, path = _short_path(directory, LISTENER)
    try:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(path)
        os.chmod(path, 0o600)
        server.listen(1)
        return server
    finally:
        os.close(fd)


def take_listener(conn: socket.socket) -> socket.socket:
    """Engine side: from an accepted handoff connection, take the listening TCP socket it carries."""
    conn.setblocking(True)
    conn.settimeout(10)
    peer_uid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))[1]
    if peer_uid != os.geteuid():
        raise ControlProtocolError(LISTENER, f"the HTTP socket came from uid {peer_uid}, not from us")
    _, fds, _, _ = socket.recv_fds(conn, 16, 1)
    if not fds:
        raise ControlProtocolError(LISTENER, "no socket was passed")
    return socket.socket(fileno=fds[0])


def receive_listener(server: socket.socket, timeout_s: float) -> socket.socket:
    """Engine side, blocking: accept one handoff connection and take its socket."""
    server.settimeout(timeout_s)
    try:
        conn, _ = server.accept()
    except socket.timeout:
        raise PhaseTimeout("wait for the HTTP socket", timeout_s) from None
    with conn:
        return take_listener(conn)


def send_listener(directory: Path, listener: socket.socket, peer_allowed: Callable[[int], bool],
                  timeout_s: float = 30) -> None:
    """Orchestrator side: pass the bound, listening TCP socket into the tree. directory/listen.sock
    is the tree's to write: it must be a socket itself (a link to another socket is not followed),
    and the process listening on it (its PID as this process sees it) must pass ``peer_allowed``."""
    path = directory / LISTENER

    def refused(reason: str) -> ControlProtocolError:
        error = ControlProtocolError(path, reason)
        error.hint = "the restored tree did not offer its own socket: read its engine log; nothing was handed over"
        return error

    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        try:
            sock_fd = os.open(LISTENER, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        except OSError as exc:
            raise refused(f"cannot open it: {exc.strerror}") from None
        try:
            if not stat.S_ISSOCK(os.fstat(sock_fd).st_mode):
                raise refused("not a socket (a link or another file is never followed)")
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                conn.settimeout(timeout_s)
                try:
                    conn.connect(f"/proc/self/fd/{sock_fd}")  # the inode just checked, not the name again
                    peer_pid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                                   struct.calcsize("3i")))[0]
                    if not peer_allowed(peer_pid):
                        raise refused(f"the process listening on it (pid {peer_pid}) is not in the tree")
                    socket.send_fds(conn, [b"listener"], [listener.fileno()])
                except OSError as exc:  # refused, reset, timed out: the tree's socket, not the host's state
                    raise refused(f"the handoff failed: {exc.strerror or type(exc).__name__}") from None
        finally:
            os.close(sock_fd)
    finally:
        os.close(dir_fd)


class HeartbeatWatch:
    """The tree's side of one heartbeat file: why the tree should stop, or None.

    owner.json must exist (``optional=False``: a tree always has an owner or was handed over);
    activator.json only while an activation runs (``optional=True``). A file that cannot be
    opened for want of descriptors or memory (OutOfResources: clients of the restored server
    can use up its descriptors) is no verdict: the watch falls back on lstat, which takes no
    descriptor. The file it read last is kept with its inode and times: while that very file is
    still there, its content still holds (a detached owner stays detached); a newer file was
    written at its mtime, so its writer was alive then. Only a heartbeat silent for ``timeout_s`` ends the tree.
    """

    def __init__(self, control_dir: Path, name: str = OWNER, timeout_s: float = OWNER_TIMEOUT_S, *,
                 optional: bool = False, role: str = "owns") -> None:
        self.control_dir, self.name, self.timeout_s = control_dir, name, timeout_s
        self.optional, self.role = optional, role
        self.label = name.removesuffix(".json")
        self._last: Owner | None = None
        self._version: tuple[int, ...] | None = None

    def verdict(self, now: float | None = None) -> str | None:
        now = time.time() if now is None else now
        try:
            read = _read_file(self.control_dir, self.name)
        except OutOfResources:
            return self._verdict_by_stat(now)
        except ControlProtocolError as exc:
            return f"{self.label} file unusable: {exc.reason}"
        except OSError:  # a read or fstat that failed (EIO, ENOMEM): no verdict either way
            return self._verdict_by_stat(now)
        if read is None:
            return None if self.optional else f"no {self.label} file"
        data, st = read
        try:
            beat = _parse(data, self.control_dir / self.name, Owner)
        except ControlProtocolError as exc:
            return f"{self.label} file unusable: {exc.reason}"
        self._last, self._version = beat, _version(st)
        return self._judge(beat.pid, beat.beat, beat.detached, now)

    def _verdict_by_stat(self, now: float) -> str | None:
        try:
            st = os.lstat(self.control_dir / self.name)
        except FileNotFoundError:
            return None if self.optional else f"no {self.label} file"
        except OSError:
            return None  # cannot tell: the next look decides
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            return f"{self.label} file unusable: not a regular file of ours"
        last = self._last
        if last is not None and self._version == _version(st):
            return self._judge(last.pid, last.beat, last.detached, now)
        # rewritten since the last read: its writer beat at its mtime (its content is unknown, so
        # a handover written just then reads as a beat; see docs/troubleshooting.md)
        pid = last.pid if last is not None else 0
        return self._judge(pid, max(st.st_mtime, last.beat if last is not None else 0.0), False, now)

    def _judge(self, pid: int, beat: float, detached: bool, now: float) -> str | None:
        if detached:
            return None
        silent = now - beat
        if silent > self.timeout_s:
            return f"the vsnap process {pid} that {self.role} this tree has been silent for {silent:.0f} s"
        return None


def _version(st: os.stat_result) -> tuple[int, ...]:
    """One file as written: its inode and times (a filesystem may give a new file the inode of
    the one its rename just replaced, as ext4 does, but not the same times as well)."""
    return st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns


def owner_gone(control_dir: Path, now: float | None = None) -> str | None:
    """Why the tree should stop (its owner is silent), or None while it is owned or detached. One
    look, with no memory of earlier ones: the tree's watchdog keeps a HeartbeatWatch instead."""
    return HeartbeatWatch(control_dir).verdict(now)


def error_report(phase: str, error: BaseException, **detail: Any) -> ErrorReport:
    # the exception's scalar attributes that a record can carry (a NaN, an int past 64 bits or a
    # lone surrogate would make the report itself fail, and hide the error)
    attributes = vars(error).items() if hasattr(error, "__dict__") else ()
    fields = {k: v for k, v in attributes
              if isinstance(k, str) and isinstance(v, (str, int, float)) and is_plain({k: v})}
    return ErrorReport(
        phase=phase, type=type(error).__name__, message=str(error) or type(error).__name__,
        detail={**fields, **detail},
    )


def to_json(obj: Any) -> bytes:
    return json.dumps(obj, indent=2, sort_keys=True).encode()
