"""restore_image(): verify, CRIU restore, activate, wait for the oracle, health check.

Phases: verify image, prepare host, criu restore, recover (the engine reloads its weights and
re-runs the oracle), serve (bind and health check). Any failure after CRIU restored the tree
kills the tree, so nothing is left running.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import socket
import time
import urllib.parse
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

from vsnap.host import gpu_early as _gpu_early
from vsnap.host.cleanup import Cleanup
from vsnap.host.criu.options import LazyPagesOptions, RestoreOptions
from vsnap.host.criu.runner import CriuRunner, LazyPagesServer
from vsnap.host.events import ProgressCallback, Timings
from vsnap.host.facts import check_criu_this_boot, check_root
from vsnap.host.instances import (
    InstanceRecord,
    ProcessRef,
    new_instance_dir,
    prune_dead_runs,
    register,
    request_stop,
    running_instances,
    stop_requested,
    this_process,
    unregister,
)
from vsnap.host.netns import NetnsHolder
from vsnap.host.paths import RUNTIME_DIR, require_runtime_dir, require_safe_directory
from vsnap.host.proctree import (
    ProcessIdentity,
    alive,
    become_subreaper,
    identify_restored_root,
    in_tree_namespace,
    is_same,
    is_tree_root,
    is_vsnap_command,
    kill_tree,
    our_children,
    reap,
    tree_memory_bytes,
    tree_pids,
)
from vsnap.host.shm import instance_shm_dir, put_back, remove_instance_shm, shm_dir_of
from vsnap.host.trust import (
    copy_no_follow,
    make_trusted_dirs,
    require_trusted_ancestors,
    require_trusted_file,
    require_trusted_tree,
)
from vsnap.host.verified import VERIFIED_DIR
from vsnap.image.compat import HostDifference, current_facts, require_host_matches
from vsnap.image.manifest import CRIU_DIR, ENGINE_LOG, SHM_DIR, TREE_DIRS, WEIGHTS_DIR, Manifest, read_manifest
from vsnap.image.origin import manifest_sha256
from vsnap.image.store import held_lock, image_read_lock, verify_files
from vsnap.protocol import control
from vsnap.protocol.control import Activation, ErrorReport, Standby, Status
from vsnap.protocol.errors import (
    CheckpointError,
    EngineError,
    HostNotReady,
    ImageChanged,
    InstanceNotStandby,
    NothingRunning,
    OracleMismatch,
    ProcessTreeError,
    UnknownInstance,
    UnsupportedOption,
    VsnapError,
)

RESTORE_LOG = "restore.log"
LAZY_PAGES_LOG = "lazy-pages.log"
PIDFILE_DIR = RUNTIME_DIR / "pids"  # CRIU's pidfiles: root's alone, never inside a tree's control directory
ACTIVATION_LOCK = "activation.lock"  # in a standby's instance directory, held by `vsnap activate`
RECOVER_TIMEOUT_S = 600.0
T = TypeVar("T")


@dataclass
class RestoredServer:
    pid: int
    host: str
    port: int
    image_dir: Path
    instance_id: str
    instance_dir: Path  # this instance's control files and logs (bound at the tree's control path)
    gpu: str | None = None  # the GPU's UUID; a tensor-parallel image's, one per rank, comma-separated
    timings: dict[str, float] = field(default_factory=dict)
    recovery: dict[str, float] = field(default_factory=dict)
    weights_source: str | None = None  # vllm: "image weights file" or "model files"
    hashed_files: int = 0  # image files hashed by this restore (the others were verified before, unchanged)
    heartbeat: control.OwnerHeartbeat | None = None
    lazy_pages: LazyPagesServer | None = None  # still sending the tree's memory, when restored lazily
    identity: ProcessIdentity | None = None  # the tree's root, as restored (PID + start time)
    state: str = "serving"  # or "standby": CRIU restored it, its CUDA state still checkpointed, no port
    memory_bytes: int | None = None  # a standby's host memory (the tree's proportional set size)
    host_warnings: list[str] = field(default_factory=list)  # facts that differ from the capturing host's, not fatal
    tls: bool = False  # the server speaks HTTPS (the spec gave vLLM a TLS key or certificate)

    @property
    def url(self) -> str:
        return server_url(self.host, self.port, tls=self.tls)

    @property
    def engine_log(self) -> Path:
        return self.instance_dir / control.ENGINE_LOG

    @property
    def restore_log(self) -> Path:
        return self.instance_dir / RESTORE_LOG

    def detach(self) -> None:
        """Let the server outlive this process (otherwise it stops soon after this process dies)."""
        if self.heartbeat is not None:
            self.heartbeat.detach()


def server_url(host: str, port: int, *, tls: bool = False) -> str:
    """A URL a client can use: a wildcard address becomes loopback, IPv6 addresses are bracketed."""
    if host in ("0.0.0.0", ""):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    scheme = "https" if tls else "http"
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


def _vllm_serve(manifest: Manifest) -> dict[str, Any] | None:
    serve = manifest.spec.get("serve") if manifest.engine == "vllm" else None
    return serve if isinstance(serve, dict) else None


def serves_tls(manifest: Manifest) -> bool:
    """Does the image's server speak HTTPS (vLLM's serve.ssl_keyfile / ssl_certfile)?"""
    serve = _vllm_serve(manifest)
    if serve is None:
        return False
    from vsnap.engine.adapters.vllm.serve_args import serves_tls as of_serve

    return of_serve(serve)


def require_serving_files(manifest: Manifest) -> None:
    """The files the restored server reads as root when it starts (vLLM's TLS files) are root's
    alone and regular, as at capture (ImageUntrusted naming the file). Not their bytes: a renewed
    certificate is what the server should read."""
    serve = _vllm_serve(manifest)
    if serve is None:
        return
    from vsnap.engine.adapters.vllm.serve_args import files_read_when_serving

    for argument, path in files_read_when_serving(serve):
        require_trusted_file(Path(path), f"the serve.{argument}")


def check_port_free(host: str, port: int) -> None:
    """Fail before CRIU runs if host:port cannot be bound (port 0: any free port, always fine)."""
    if port != 0:
        bind_listener(host, port).close()


def _int(value: object) -> int:
    """A number the tree reported (its control files are its to write), -1 when it is none."""
    return value if isinstance(value, int) and not isinstance(value, bool) else -1


def _engine_failure(report: ErrorReport, log: Path) -> EngineError:
    if report.type == "OracleMismatch":
        d = report.detail
        return OracleMismatch(_int(d.get("prompt")), _int(d.get("position")), str(d.get("expected", "?"))[:200],
                              str(d.get("actual", "?"))[:200], log_path=log)
    return EngineError(report.phase[:100], report.type[:100], report.message[:2000], log_path=log)  # the tree's words, cut


def _wait_status(control_dir: Path, tree: ProcessIdentity, want: tuple[str, ...], phase: str, log: Path) -> Status:
    def probe() -> Status | None:
        report = control.read_message(control_dir, control.ERROR, ErrorReport)
        if report is not None:
            raise _engine_failure(report, log)
        status = control.read_message(control_dir, control.STATUS, Status)
        if status is not None and status.state in want:
            return status
        if not is_same(tree):
            raise EngineError(phase, "EngineExited", "the restored engine exited without reporting why", log_path=log)
        return None

    return control.wait_until(probe, timeout_s=RECOVER_TIMEOUT_S, phase=phase, interval_s=0.005, log_path=log)


def bind_listener(host: str, port: int) -> socket.socket:
    """The HTTP socket, bound on the host (the tree's own network namespace is not reachable)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(512)
    except OSError as exc:
        sock.close()
        raise HostNotReady("port", f"cannot serve on {host}:{port}: {exc.strerror}",
                           hint="choose another --port, or stop what listens there") from None
    return sock


@contextmanager
def handed_over_listener(work: Path, tree: ProcessIdentity, host: str, port: int, log: Path) -> Iterator[int]:
    """Bind host:port here, pass the socket into the validated tree, wait until it says it serves;
    yield the port bound (the one asked for, or the one the kernel chose for 0: never what the tree
    says). vsnap's own copy of the socket stays open until the block ends: if the tree drops its
    copy (uvicorn failing on its TLS files, say), the port stays bound, and no one else's server
    can answer the health check in the tree's place."""
    with bind_listener(host, port) as listener:
        control.send_listener(work, listener, peer_allowed=lambda pid: in_tree_namespace(pid, tree))
        _wait_status(work, tree, ("serving",), "serve", log)
        yield int(listener.getsockname()[1])


def tree_failure(work: Path, tree: ProcessIdentity, log: Path) -> EngineError | None:
    """Why the tree can no longer be serving: the error it reported, or that it is gone; None if neither."""
    report = control.read_message(work, control.ERROR, ErrorReport)
    if report is not None:
        return _engine_failure(report, log)
    if not is_same(tree):
        return EngineError("serve", "EngineExited", "the restored engine exited before /health answered", log_path=log)
    return None


def restore_pidfile(instance_id: str) -> Path:
    """Where CRIU writes the restored root's PID: a directory of root's alone (make_trusted_dirs),
    not the instance directory, which the restored tree sees as its control directory and could
    rewrite before vsnap reads it (CriuRunner.restore reads it once and removes it)."""
    return control.ensure_private_dir(make_trusted_dirs(PIDFILE_DIR)) / f"{instance_id}.pid"


def health_check(url: str, timeout_s: float = 30, stop: Callable[[], BaseException | None] | None = None) -> None:
    """GET ``url``/health until it answers 200 (EngineError HealthCheckFailed after ``timeout_s``,
    a deadline no server can stretch by answering slowly); between attempts ``stop`` may name a
    reason to give up (the tree's error, the tree gone), which is raised.

    One request line over a plain socket, not urllib: urllib.request (with http.client, email and
    ssl) was 12 to 19 ms of every restore's start, and its getaddrinfo of the host imported the
    idna codec in the serve phase. What a failure reports keeps urllib's wording. No proxy is
    asked (urllib would have sent even 127.0.0.1 through $http_proxy unless $no_proxy named it).
    """
    parts = urllib.parse.urlsplit(url)
    tls = parts.scheme == "https"
    host, port = parts.hostname or "127.0.0.1", parts.port or (443 if tls else 80)
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        answer = _get_health(host, port, deadline=min(deadline, time.monotonic() + 5), tls=tls)
        if answer is None:
            return
        last = answer
        reason = stop() if stop is not None else None
        if reason is not None:
            raise reason
        time.sleep(0.02)
    raise EngineError("serve", "HealthCheckFailed", f"{url}/health did not answer 200 ({last})")


def _get_health(host: str, port: int, deadline: float, *, tls: bool = False) -> str | None:
    """One GET /health, given up at ``deadline`` (time.monotonic()): None if it answered 200, else
    what it did (in urllib's words). Over TLS the certificate is not checked: this asks the tree
    vsnap restored, on the socket vsnap still holds, whether it serves; what a client trusts is
    the client's to check."""
    netloc = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def left() -> float:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("timed out")
        return remaining

    try:
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    except OSError as exc:
        return f"<urlopen error {exc}>"
    if tls:
        import ssl  # only for a server that speaks TLS (12 to 19 ms with urllib: see health_check)

        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        sock = context.wrap_socket(sock, server_hostname=host, do_handshake_on_connect=True)
    with sock:
        try:
            sock.settimeout(left())
            sock.connect((host, port))
            sock.settimeout(left())
            sock.sendall(f"GET /health HTTP/1.1\r\nHost: {netloc}\r\nConnection: close\r\n\r\n".encode())
        except OSError as exc:
            return f"<urlopen error {exc}>"
        status_line = b""
        try:
            while not status_line.endswith(b"\n") and len(status_line) < 65537:
                sock.settimeout(left())  # per read, against the one deadline: a trickle cannot stretch it
                chunk = sock.recv(min(4096, 65537 - len(status_line)))
                if not chunk:
                    break
                status_line += chunk
                if b"\n" in status_line:
                    status_line = status_line[:status_line.index(b"\n") + 1]
        except OSError as exc:
            return str(exc)
    if not status_line:
        return "Remote end closed connection without response"
    version, _, rest = status_line.decode("latin-1").rstrip("\r\n").partition(" ")
    code, _, reason = rest.partition(" ")
    if not version.startswith("HTTP/") or not code.isdigit():
        return f"not an HTTP answer: {status_line[:80]!r}"
    if code == "200":
        return None
    return f"HTTP {code}" if code.startswith("2") else f"HTTP Error {code}: {reason.strip()}"


def verify_image(image_dir: Path, *, rehash: bool = False) -> Manifest:
    """Everything a restore checks before CRIU starts: manifest, every file's sha256, this host.

    Files this host hashed before and that did not change since are not hashed again (see
    _verified) unless ``rehash``.
    """
    manifest = read_manifest(image_dir)
    verify_files(image_dir, manifest, cache_root=VERIFIED_DIR, rehash=rehash)
    require_host_matches(manifest, cache_root=VERIFIED_DIR)
    return manifest


def _note_host_differences(differences: list[HostDifference]) -> Callable[..., bool]:
    """An exit callback that adds to a failed restore's hint the facts in which this host differs
    from the capturing one without being refused (a CRIU failure on another kernel, say)."""
    def add_note(exc_type: object, exc: BaseException | None, tb: object) -> bool:
        if isinstance(exc, VsnapError) and differences:
            note = (f"this host differs from the capturing one in {', '.join(d.fact for d in differences)} "
                    "(not refused; vsnap validate IMAGE lists each)")
            exc.hint = f"{exc.hint}; {note}" if exc.hint else note
        return False

    return add_note


def read_ahead(directory: Path) -> None:
    """Ask the kernel to start reading these files into the page cache (returns at once)."""
    for path in directory.glob("*"):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        finally:
            os.close(fd)


def check_lazy_pages(runner: CriuRunner) -> None:
    if not runner.check_feature("uffd-noncoop"):
        raise HostNotReady("criu", "this kernel cannot serve lazy pages (`criu check --feature uffd-noncoop` fails)",
                           hint="restore without --lazy-pages")


def _check_stop(work: Path) -> None:
    """`vsnap stop` asked this restore to give up (it is checked between phases)."""
    if stop_requested(work):
        raise CheckpointError("stopped by `vsnap stop` while restoring", phase="restore",
                              hint="nothing was left running; restore again when you want it")


class CheckClock:
    """How long each check of the verify phase took (they run side by side): ``verify_<name>_s``."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._start = time.monotonic()

    def call(self, name: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        start = time.monotonic()
        try:
            return fn(*args, **kwargs)
        finally:
            self.seconds[f"verify_{name}_s"] = time.monotonic() - start

    def mark(self, name: str) -> None:
        """The serial part so far, since the clock started or the last mark."""
        now = time.monotonic()
        self.seconds[f"verify_{name}_s"] = now - self._start
        self._start = now


@dataclass
class _Tree:
    """A tree CRIU restored, on its way to serving: what the phases after CRIU need."""

    image_dir: Path
    manifest: Manifest
    work: Path  # its instance directory
    identity: ProcessIdentity
    record: InstanceRecord

    @property
    def engine_log(self) -> Path:
        return self.work / control.ENGINE_LOG

    @property
    def weights_dir(self) -> Path:
        return self.image_dir / WEIGHTS_DIR


def restore_image(image_dir: Path, *, host: str = "127.0.0.1", port: int = 8000, gpu: str | None = None,
                  rehash: bool = False, lazy_pages: bool = False, standby: bool = False,
                  on_event: ProgressCallback | None = None) -> RestoredServer:
    """Restore a new instance of the image's tree, activate it on host:port and return once it serves.

    Each call gets its own instance directory, PID namespace and (for vLLM) GPU: ``gpu`` is an
    index or UUID (a tensor-parallel image: one per rank, comma-separated); by default the
    captured GPU if present, else the first of the same model with enough free memory. ``rehash``: hash every image file even if this host verified it before.
    ``lazy_pages``: CRIU maps the tree's memory and a `criu lazy-pages` server fills it on first
    touch (then pushes the rest), so CRIU returns sooner. ``standby``: stop after CRIU restored the
    tree, its CUDA state still checkpointed (no GPU memory, no port): `activate_instance` serves it.

    Before anything runs, the image must pass the trust model (_trust: root's alone, every path
    inside it) and its files must match the manifest; a shared lock on the image is held from
    then until the engine has read the image's weights, so a capture cannot replace it meanwhile
    (a standby's activation takes it again and checks the image is still the one restored).
    Every resource is released on every failure (_cleanup); the instance directory stays, with
    the logs the error names.
    """
    image_dir = Path(image_dir).absolute()
    timings = Timings(on_event)
    if standby and gpu is not None:
        raise UnsupportedOption("--gpu", f"--gpu {_shown(gpu)}: a standby holds no GPU; give --gpu to `vsnap activate`")
    if standby and lazy_pages:
        raise UnsupportedOption("--lazy-pages", "a standby's memory is restored in full before it waits; "
                                                "restore it without --lazy-pages")
    lazy: LazyPagesServer | None = None
    host_warnings: list[HostDifference] = []
    with Cleanup() as cleanup, ExitStack() as reading, ExitStack() as noting:
        noting.push(_note_host_differences(host_warnings))
        clock = CheckClock()
        with timings.phase("verify image"):
            check_root()
            require_runtime_dir()  # the records and caches it writes (the CLI checked it too)
            require_trusted_tree(image_dir)  # before a byte of the image is read (verify_files walks it again)
            reading.enter_context(image_read_lock(image_dir))
            manifest = read_manifest(image_dir)
            if gpu is not None and not manifest.cuda_processes:
                raise UnsupportedOption("--gpu", f"--gpu {_shown(gpu)}: {image_dir} holds no CUDA state "
                                                 f"(engine {manifest.engine}); there is no GPU to choose")
            control_dir = Path(manifest.control_dir)
            require_safe_directory(manifest.control_dir, "the manifest's control_dir")
            require_trusted_ancestors(control_dir)
            if not standby:  # a standby reads them when it is activated
                require_serving_files(manifest)
            clock.mark("trust_and_manifest")
            # Independent checks side by side (the GPU ones start the CUDA driver, which the CUDA
            # restore needs anyway); the first failure in this order is the one reported.
            # (submitted before what waits for them: the pool starts its jobs in order, so nothing
            # waits for a job that has no thread)
            with ThreadPoolExecutor(max_workers=8) as pool:
                # the GPUs' facts once, for the host check and the GPU choice (two threads asking
                # the driver side by side slowed the 8B's verify phase from 0.17 s to 0.25 to 0.32 s)
                gpus = pool.submit(clock.call, "gpu_facts", _gpu_early.gpu_facts) if manifest.cuda_processes else None
                hashing = pool.submit(clock.call, "files", verify_files, image_dir, manifest, cache_root=VERIFIED_DIR,
                                      rehash=rehash)
                # the host's facts (CRIU's and the packages' versions, the GPUs) while the host check
                # compares the dependency files; it then waits for them
                facts = pool.submit(clock.call, "host_facts", current_facts, manifest, gpus)
                host_fit = pool.submit(clock.call, "host", require_host_matches, manifest, facts, cache_root=VERIFIED_DIR)
                checks = [pool.submit(clock.call, "criu", check_criu_this_boot, VERIFIED_DIR), hashing, host_fit]
                if not standby:  # a standby binds no port and takes no GPU until it is activated
                    checks.append(pool.submit(clock.call, "port", check_port_free, host, port))
                if lazy_pages:
                    checks.append(pool.submit(check_lazy_pages, CriuRunner.locate()))
                choosing = (pool.submit(clock.call, "gpu", choose_gpus, manifest, gpu, gpus)
                            if manifest.cuda_processes and not standby else None)
                for check in checks:
                    check.result()
                target = choosing.result() if choosing is not None else None
                host_warnings += host_fit.result()  # differences that do not stop a restore
        prune_dead_runs()
        weights_dir = image_dir / WEIGHTS_DIR
        with timings.phase("prepare host"):
            read_ahead(weights_dir)  # read while CRIU and CUDA restore; the engine streams it at recover
            control.ensure_private_dir(make_trusted_dirs(control_dir))  # the mount point inside the tree
            instance_id, work = new_instance_dir(control_dir, "r")
            record = InstanceRecord(id=instance_id, image=str(image_dir), name=manifest.name, state="restoring",
                                    owner=this_process(), instance_dir=str(work), started_at=time.time(),
                                    image_digest=image_digest(image_dir, manifest))
            register(record)  # `vsnap ps` and `vsnap stop` see it from now on
            cleanup.on_failure(unregister, instance_id)
            # CRIU reopens the log at its captured size and mode: put the captured log back.
            copy_no_follow(image_dir / ENGINE_LOG, work / control.ENGINE_LOG)
            if manifest.engine == "vllm":
                for name in TREE_DIRS:
                    (work / name).mkdir(mode=0o700)
            if standby:  # before CRIU: the tree's first look at its control directory sees it
                control.write_message(work, control.STANDBY, Standby(since=time.time(), **control.stamp()))
            shm_dir = instance_shm_dir(instance_id)
            cleanup.on_failure(remove_instance_shm, shm_dir)
            put_back(image_dir / SHM_DIR, manifest.shm_files, shm_dir)
            become_subreaper()
        engine_log = work / control.ENGINE_LOG
        externals = {**manifest.externals, manifest.control_mount_key: str(work), manifest.shm_mount_key: str(shm_dir)}
        restored: list[ProcessIdentity] = []
        heartbeat = control.OwnerHeartbeat(work, while_alive=lambda: not restored or is_same(restored[0]))
        heartbeat.start()
        cleanup.on_failure(heartbeat.stop)
        _check_stop(work)
        with timings.phase("criu restore"):
            netns = NetnsHolder()
            cleanup.on_exit(netns.close)
            runner = CriuRunner.locate()
            if lazy_pages:
                lazy = runner.start_lazy_pages(LazyPagesOptions(
                    images_dir=image_dir / CRIU_DIR, work_dir=work, log_file=work / LAZY_PAGES_LOG))
                cleanup.on_failure(lazy.kill)
            children_before = our_children()  # the restored root must be a new one
            pid = runner.restore(RestoreOptions(
                images_dir=image_dir / CRIU_DIR, work_dir=work, log_file=work / RESTORE_LOG,
                pidfile=restore_pidfile(instance_id), externals=externals,
                inherit_fds={int(netns.fd or -1): manifest.netns_key}, lazy_pages=lazy_pages))
            identity = identify_restored_root(pid, children_before)  # a new child, its namespace's PID 1
            if identity is None:
                reap(pid)
                raise EngineError("criu restore", "EngineExited", f"the restored tree (pid {pid}) exited at once, or "
                                  "is not a PID namespace's first process handed to vsnap", log_path=engine_log)
            restored.append(identity)
            cleanup.on_failure(kill_tree, identity)
            record = record.model_copy(update={"tree": ProcessRef.of(identity)})
            register(record)
            netns.close()  # the restored tree keeps the namespace alive
        _check_stop(work)
        tree = _Tree(image_dir, manifest, work, identity, record)
        if standby:
            reading.close()  # CRIU has read its pages; the activation locks the image again for the weights
            register(record.model_copy(update={"state": "standby"}))
            server = RestoredServer(pid, host, 0, image_dir, instance_id, work, identity=identity, state="standby",
                                    memory_bytes=tree_memory_bytes(pid))
        else:
            server = _bring_up(tree, host, port, target, timings, reading)
    server.heartbeat = heartbeat
    server.lazy_pages = lazy
    server.timings = dict(timings.seconds)
    server.hashed_files = len(hashing.result())
    server.host_warnings = [f"{d.line} ({d.why})" for d in host_warnings]
    server.recovery.update(clock.seconds)
    return server


def _bring_up(tree: _Tree, host: str, port: int, targets: list[dict] | None, timings: Timings,
              reading: ExitStack) -> RestoredServer:
    """CUDA restore (onto ``targets``, one GPU per rank), recover (weights, oracle), then serve on
    host:port: the phases after CRIU, shared by a restore and a standby's activation. ``reading``
    holds the image's readers' lock: released once the engine has read the weights."""
    manifest, work, identity, engine_log = tree.manifest, tree.work, tree.identity, tree.engine_log
    if manifest.cuda_processes:
        from vsnap.host.cuda import CudaCheckpoint

        with timings.phase("cuda restore"):
            cuda = CudaCheckpoint()
            cuda_pids = cuda.cuda_pids(tree_pids(identity.pid))
            if len(cuda_pids) != manifest.cuda_processes:
                raise ProcessTreeError(identity.pid, f"{len(cuda_pids)} CUDA processes after restore, "
                                                     f"{manifest.cuda_processes} at capture", phase="cuda restore")
            cuda.restore(cuda_pids, gpu_pairs=gpu_pairs(manifest.captured_gpus(), targets))
        _check_stop(work)
    with timings.phase("recover"):
        control.write_message(work, control.ACTIVATION, Activation(
            host=host, port=port, weights_dir=str(tree.weights_dir) if tree.weights_dir.is_dir() else None,
            **control.stamp()))
        validated = _wait_status(work, identity, ("validated",), "recover", engine_log)
    reading.close()  # the engine has read the image's weights: a capture may replace it now
    _check_stop(work)
    with timings.phase("serve"):
        started = time.monotonic()
        with handed_over_listener(work, identity, host, port, engine_log) as bound:
            handed_over = time.monotonic()
            server = RestoredServer(identity.pid, host, bound, tree.image_dir, tree.record.id, work,
                                    gpu=",".join(t["uuid"] for t in targets) if targets else None,
                                    identity=identity, tls=serves_tls(tree.manifest))
            health_check(server.url, stop=lambda: tree_failure(work, identity, engine_log))
        serve_split = {"socket_handoff_s": handed_over - started, "http_start_s": time.monotonic() - handed_over}
        failure = tree_failure(work, identity, engine_log)  # it answered; is it still the tree, serving?
        if failure is not None:
            raise failure
    _check_stop(work)
    register(tree.record.model_copy(update={"state": "serving", "url": server.url, "port": server.port,
                                            "gpu": server.gpu, "activator": None}))
    t = validated.times
    server.recovery = {k: v for k, v in validated.detail.items() if isinstance(v, (int, float))}
    server.weights_source = validated.detail.get("weights_source")
    if "recovered" in t and "oracle_checked" in t:
        server.recovery["oracle_s"] = t["oracle_checked"] - t["recovered"]
    server.recovery.update(serve_split)  # the serve phase: socket handoff, then the server's own start
    return server


def standby_record(instance_id: str) -> InstanceRecord:
    """The running standby ``instance_id`` (UnknownInstance / NothingRunning / InstanceNotStandby)."""
    running = running_instances()
    if not running:
        raise NothingRunning(f"no vsnap instance is running (no standby {instance_id} to activate)")
    record = next((r for r in running if r.id == instance_id), None)
    if record is None:
        standbys = [r.id for r in running if r.state == "standby"]
        raise UnknownInstance(instance_id, hint=f"standbys: {', '.join(standbys[:5])}" if standbys
                              else "no instance is standing by: `vsnap restore IMAGE --standby` makes one")
    if record.state != "standby":
        raise InstanceNotStandby(instance_id, record.state)
    return record


def activate_instance(instance_id: str, *, host: str = "127.0.0.1", port: int = 8000, gpu: str | None = None,
                      on_event: ProgressCallback | None = None) -> RestoredServer:
    """Serve the standby ``instance_id``: CUDA restore onto ``gpu`` (as restore_image chooses it),
    weights from its image, the oracle, then host:port. Its owner stays whoever restored it (a
    foreground `vsnap restore --standby` still ends it on Ctrl-C; a detached one runs on).

    The image must be the one the standby was restored from (same manifest, files unchanged, the
    trust model again): it is read again for the weights, under its readers' lock. On any
    failure the standby is ended (its GPU state may be half restored); nothing is left running.
    """
    timings = Timings(on_event)
    clock = CheckClock()
    with Cleanup() as cleanup, ExitStack() as held, ExitStack() as reading:
        with timings.phase("verify image"):
            check_root()
            require_runtime_dir()
            record = standby_record(instance_id)
            if record.tree is None or Path(record.instance_dir).name != record.id:
                raise ProcessTreeError(None, f"the record of {record.id} names no tree, or another directory",
                                       phase="activate")
            _require_tree_root(record, "activate")
            identity = record.tree.identity
            work, image_dir = Path(record.instance_dir), Path(record.image)
            held.enter_context(activation_lock(work, instance_id))
            record = standby_record(instance_id)  # again, under the lock: another activation may have won
            require_trusted_tree(image_dir)
            reading.enter_context(image_read_lock(image_dir))
            manifest = read_manifest(image_dir)
            if record.image_digest not in (image_digest(image_dir, manifest), manifest_digest(manifest)):
                raise ImageChanged(image_dir, instance_id)  # (the second: standbys recorded before image_digest)
            if gpu is not None and not manifest.cuda_processes:
                raise UnsupportedOption("--gpu", f"--gpu {_shown(gpu)}: {image_dir} holds no CUDA state "
                                                 f"(engine {manifest.engine}); there is no GPU to choose")
            require_serving_files(manifest)
            clock.mark("trust_and_manifest")
            with ThreadPoolExecutor(max_workers=3) as pool:
                checks = [pool.submit(clock.call, "files", verify_files, image_dir, manifest, cache_root=VERIFIED_DIR),
                          pool.submit(clock.call, "port", check_port_free, host, port)]
                choosing = pool.submit(clock.call, "gpu", choose_gpus, manifest, gpu) if manifest.cuda_processes else None
                for check in checks:
                    check.result()
                target = choosing.result() if choosing is not None else None
            if not is_same(identity):
                raise ProcessTreeError(identity.pid, f"standby {instance_id}'s tree is gone", phase="activate")
            activating = record.model_copy(update={"state": "activating", "activator": this_process()})
            register(activating)
            # a failed activation ends the standby: its CUDA state may be half restored. Released
            # newest first: the tree goes before its /dev/shm directory, which is never removed
            # while a live tree has it bound (the restore path registers them in the same order)
            cleanup.on_failure(unregister, instance_id)
            cleanup.on_failure(remove_instance_shm, shm_dir_of(instance_id))
            cleanup.on_failure(kill_tree, identity)
        _check_stop(work)
        server = _bring_up(_Tree(image_dir, manifest, work, identity, activating), host, port, target, timings,
                           reading)
    server.timings = dict(timings.seconds)
    server.recovery.update(clock.seconds)
    return server


@contextmanager
def activation_lock(work: Path, instance_id: str) -> Iterator[None]:
    """One activation of a standby at a time: a second would restore its CUDA state again, fail,
    and end the tree the first is bringing up. An flock on a file in the instance's own private
    directory (made by vsnap, opened without following links), held until the activation returns."""
    control.check_private_dir(work)
    with held_lock(work / ACTIVATION_LOCK, fcntl.LOCK_EX, 0,
                   lambda: InstanceNotStandby(instance_id, "being activated by another vsnap")):
        yield


def image_digest(image_dir: Path, manifest: Manifest) -> str:
    """What tells one capture from another at the same path (a standby records it, its activation
    checks it): sha256 of manifest.json's bytes, which no vsnap version reads differently. A
    digest of the parsed manifest (manifest_digest) changed whenever a vsnap version added a field
    with a default, so standbys failed to activate after an upgrade."""
    return manifest_sha256(image_dir) or manifest_digest(manifest)


def manifest_digest(manifest: Manifest) -> str:
    """sha256 of the manifest as this vsnap parses it: what standbys recorded before image_digest."""
    return hashlib.sha256(manifest.model_dump_json().encode()).hexdigest()


STOP_WAIT_S = 60.0


def stop_server(server: RestoredServer | InstanceRecord, grace_s: float = 10.0) -> None:
    """Stop a restored instance: SIGTERM to its root (it shuts the server down), then SIGKILL.

    Only the recorded processes are signalled (by identity, through pidfds): a record whose
    process is gone or whose PID was reused is only removed. An instance still being restored is
    asked to give up (its restore checks between phases and tears everything down); if its vsnap
    process does not within STOP_WAIT_S, that process and the tree are ended. A cleanly stopped
    instance's directory is removed with its record.
    """
    if isinstance(server, RestoredServer):
        if server.heartbeat is not None:
            server.heartbeat.stop()
        identity, instance_id, work = server.identity, server.instance_id, server.instance_dir
    else:
        if Path(server.instance_dir).name != server.id:
            raise ProcessTreeError(None, f"the record of {server.id} names another directory ({server.instance_dir})",
                                   phase="stop")
        _require_tree_root(server, "stop")
        if server.state in ("restoring", "activating"):
            _stop_restoring(server)
            return
        identity = server.tree.identity if server.tree else None
        instance_id, work = server.id, Path(server.instance_dir)
    if identity is not None:
        kill_tree(identity, grace_s=grace_s)
        reap(identity.pid)
    if isinstance(server, RestoredServer) and server.lazy_pages is not None:
        server.lazy_pages.kill()  # it ends by itself once the tree is gone; never left behind
    unregister(instance_id)
    shutil.rmtree(work, ignore_errors=True)
    remove_instance_shm(shm_dir_of(instance_id))


def _require_tree_root(record: InstanceRecord, phase: str) -> None:
    """A record's tree is acted on (signalled, activated) only while it is the first process of a
    PID namespace of its own (_proctree.is_tree_root): a record naming another live process
    (crafted, or left by a bug) is refused, not acted on. A tree that is gone is the caller's case."""
    if record.tree is not None and is_same(record.tree.identity) and not is_tree_root(record.tree.identity):
        raise ProcessTreeError(record.tree.pid, f"the record of {record.id} names pid {record.tree.pid}, which is not "
                               "the first process of a PID namespace of its own: not a vsnap tree, not signalled",
                               phase=phase)


def _stop_restoring(record: InstanceRecord) -> None:
    request_stop(record)
    deadline = time.monotonic() + STOP_WAIT_S
    while time.monotonic() < deadline:
        now = next((r for r in running_instances() if r.id == record.id), None)
        if now is None:
            return  # the restore gave up and cleaned up
        if now.state not in ("restoring", "activating"):
            stop_server(now)  # it finished (serving, or standing by) before it saw the request
            return
        working = now.activator if now.state == "activating" else now.owner
        if working is None or not is_same(working.identity):
            break  # its vsnap process died (SIGKILL) without cleaning up: no one will answer the request
        time.sleep(0.05)
    stuck = (record.activator or record.owner).identity
    if is_vsnap_command(stuck.pid):  # a stuck restore: end it (never another program a record names), then the tree
        kill_tree(stuck, grace_s=5)
    if record.tree is not None and is_tree_root(record.tree.identity):
        kill_tree(record.tree.identity)
    unregister(record.id)
    remove_instance_shm(shm_dir_of(record.id))


def gpu_pairs(captured: list[str], targets: list[dict] | None) -> list[tuple[str, str]]:
    """The CUDA restore's GPU map: rank r's captured GPU onto ``targets[r]``; none when every rank
    stays on its GPU (the driver then needs no map)."""
    if not targets or not captured:
        return []
    if len(targets) != len(captured):
        raise HostNotReady("gpu", f"{len(targets)} GPU(s) chosen for an image of {len(captured)} rank(s)")
    pairs = [(old, str(new["uuid"])) for old, new in zip(captured, targets)]
    return [] if all(old == new for old, new in pairs) else pairs


def choose_gpus(manifest: Manifest, requested: str | None,
                facts: Future[tuple[str | None, str, list[dict]]] | None = None) -> list[dict]:
    """The GPUs to restore onto, one per rank in rank order: the requested indices or UUIDs
    (``0,1``: as many as the image has ranks, each once), else each rank's captured GPU where it is
    here and has room, the other ranks on the first other GPUs of the captured model with enough
    free memory. Refuses another model or too little memory, naming the GPU. ``facts``: the GPUs'
    facts (_cuda.gpu_facts) being read elsewhere; else they are read here."""
    from vsnap.host.cuda import gpu_free_memory

    with ThreadPoolExecutor(max_workers=1) as pool:
        freeing = pool.submit(gpu_free_memory)  # while the CUDA driver starts
        _, _, gpus = facts.result() if facts is not None else _gpu_early.gpu_facts()
        free = freeing.result()
    captured = manifest.host.gpus[0] if manifest.host.gpus else {}
    need = manifest.gpu_memory_required or 0  # on each GPU: vLLM takes its share of every rank's
    ranks = manifest.tensor_parallel_size

    def fits(g: dict) -> str | None:
        if captured and g["name"] != captured.get("name"):
            return f"GPU {g['index']} is a {g['name']}; the image was captured on a {captured.get('name')}"
        available = free.get(g["uuid"])
        if available is not None and available < need:
            return (f"GPU {g['index']} has {available / 2**30:.1f} GiB free; the image needs "
                    f"{need / 2**30:.1f} GiB (gpu_memory_utilization of the captured GPU)")
        return None

    if requested is not None:
        return _requested_gpus(requested, ranks, gpus, fits)
    reasons: list[str] = []
    tried: set[str] = set()

    def take(g: dict) -> bool:
        tried.add(g["uuid"])
        reason = fits(g)
        if reason is not None:
            reasons.append(reason)
        return reason is None

    by_uuid = {g["uuid"]: g for g in gpus}
    wanted = manifest.captured_gpus()[:ranks]
    chosen: list[dict | None] = [by_uuid.get(u) for u in wanted] + [None] * (ranks - len(wanted))
    chosen = [g if g is not None and take(g) else None for g in chosen]
    for rank, g in enumerate(chosen):
        if g is None:
            chosen[rank] = next((o for o in gpus if o["uuid"] not in tried and take(o)), None)
    if any(g is None for g in chosen):
        lead = "no GPU can take this image" if ranks == 1 else f"fewer than {ranks} GPUs can take this image"
        raise HostNotReady("gpu", f"{lead}: " + "; ".join(dict.fromkeys(reasons)) if reasons else
                           ("no GPU is visible" if not gpus else f"this host has {len(gpus)} GPU(s); the image "
                                                                 f"needs {ranks} (tensor_parallel_size)"),
                           hint="stop something on a GPU, or restore on a host with free GPUs of the captured model")
    return [g for g in chosen if g is not None]


def _shown(requested: str) -> str:
    """``--gpu``'s value as an error shows it: quoted, one line and at most 80 characters of it,
    however it came."""
    return repr(requested if len(requested) <= 80 else requested[:80] + "...")


def _requested_gpus(requested: str, ranks: int, gpus: list[dict], fits: Callable[[dict], str | None]) -> list[dict]:
    """``--gpu``: one index or UUID per rank, comma-separated, each a GPU of this host taken once."""
    names = [name.strip() for name in requested.split(",")]
    example = ",".join(map(str, range(ranks)))
    shown = _shown(requested)
    if not all(names):
        raise HostNotReady("gpu", f"--gpu {shown} has an empty entry", hint=f"give one GPU index or UUID per rank, "
                                                                             f"in rank order (--gpu {example})")
    if len(names) != ranks:
        raise HostNotReady("gpu", f"--gpu {shown} names {len(names)} GPU(s); the image has "
                                  f"{ranks} rank(s) (tensor_parallel_size {ranks})",
                           hint=f"give one GPU index or UUID per rank, in rank order (--gpu {example})")
    chosen: list[dict] = []
    for name in names:
        match = [g for g in gpus if name in (str(g["index"]), g["uuid"])]
        if not match:
            raise HostNotReady("gpu", f"no GPU {name[:80]!r} on this host (have {', '.join(str(g['index']) for g in gpus)})",
                               hint="--gpu takes indices or UUIDs from nvidia-smi -L")
        if match[0] in chosen:
            raise HostNotReady("gpu", f"--gpu {shown} names GPU {match[0]['index']} twice",
                               hint=f"one GPU per rank (--gpu {example})")
        reason = fits(match[0])
        if reason:
            raise HostNotReady("gpu", reason, hint="choose another --gpu")
        chosen.append(match[0])
    return chosen


def wait_server(pid: int, poll_s: float = 0.2) -> None:
    """Block until the restored tree's root exits."""
    while alive(pid):
        time.sleep(poll_s)
    reap(pid)
