"""restore_image(): verify, CRIU restore, activate, wait for the oracle, health check.

Phases: verify image, prepare host, criu restore, recover (the engine reloads its weights and
re-runs the oracle), serve (bind and health check). Any failure after CRIU restored the tree
kills the tree, so nothing is left running.
"""

from __future__ import annotations

import shutil
import socket
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from . import _control as control
from ._control import Activation, ErrorReport, Status
from ._criu import CriuRunner
from ._criu_options import RestoreOptions
from ._errors import EngineError, HostNotReady, OracleMismatch, ProcessTreeError
from ._events import ProgressCallback, Timings
from ._host import check_criu, check_root, require_host_matches
from ._image import verify_files
from ._manifest import CRIU_DIR, ENGINE_LOG, SHM_DIR, Manifest, read_manifest
from ._proctree import alive, become_subreaper, kill_tree, reap, tree_pids
from ._shm import SHM, put_back

RESTORE_LOG = "restore.log"
RESTORE_PID = "restore.pid"
RECOVER_TIMEOUT_S = 600.0


@dataclass
class RestoredServer:
    pid: int
    host: str
    port: int
    image_dir: Path
    control_dir: Path
    engine_log: Path
    restore_log: Path
    timings: dict[str, float] = field(default_factory=dict)
    recovery: dict[str, float] = field(default_factory=dict)
    heartbeat: control.OwnerHeartbeat | None = None

    def detach(self) -> None:
        """Let the server outlive this process (otherwise it stops soon after this process dies)."""
        if self.heartbeat is not None:
            self.heartbeat.detach()

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else ("[::1]" if self.host == "::" else self.host)
        return f"http://{host}:{self.port}"


def check_port_free(host: str, port: int) -> None:
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise HostNotReady("port", f"cannot serve on {host}:{port}: {exc.strerror}",
                               hint="choose another --port, or stop what listens there") from None


def running_instance(control_dir: Path) -> int | None:
    """The PID of a restored tree still using this control directory, if any."""
    try:
        pid = int((control_dir / RESTORE_PID).read_text().strip())
    except (OSError, ValueError):
        return None
    return pid if alive(pid) else None


def _engine_failure(report: ErrorReport, log: Path) -> EngineError:
    if report.type == "OracleMismatch":
        d = report.detail
        return OracleMismatch(int(d.get("prompt", -1)), int(d.get("position", -1)), str(d.get("expected", "?")),
                              str(d.get("actual", "?")), log_path=log)
    return EngineError(report.phase, report.type, report.message, log_path=log)


def _wait_status(control_dir: Path, pid: int, want: tuple[str, ...], phase: str, log: Path) -> Status:
    def probe() -> Status | None:
        report = control.read_message(control_dir, control.ERROR, ErrorReport)
        if report is not None:
            raise _engine_failure(report, log)
        status = control.read_message(control_dir, control.STATUS, Status)
        if status is not None and status.state in want:
            return status
        if not alive(pid):
            raise EngineError(phase, "EngineExited", "the restored engine exited without reporting why", log_path=log)
        return None

    return control.wait_until(probe, timeout_s=RECOVER_TIMEOUT_S, phase=phase, interval_s=0.005, log_path=log)


def health_check(url: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                if response.status == 200:
                    return
                last = f"HTTP {response.status}"
        except (urllib.error.URLError, OSError) as exc:
            last = str(exc)
        time.sleep(0.02)
    raise EngineError("serve", "HealthCheckFailed", f"{url}/health did not answer 200 ({last})")


def verify_image(image_dir: Path) -> Manifest:
    """Everything a restore checks before CRIU starts: manifest, every file's sha256, this host."""
    manifest = read_manifest(image_dir)
    verify_files(image_dir, manifest)
    require_host_matches(manifest)
    return manifest


def restore_image(image_dir: Path, *, host: str = "127.0.0.1", port: int = 8000,
                  on_event: ProgressCallback | None = None) -> RestoredServer:
    """Restore the image's tree, activate it on host:port and return once it serves."""
    image_dir = Path(image_dir).absolute()
    timings = Timings(on_event)
    with timings.phase("verify image"):
        check_root()
        check_criu()
        manifest = verify_image(image_dir)
        check_port_free(host, port)
    control_dir = Path(manifest.control_dir)
    with control.control_lock(control.ensure_private_dir(control_dir)):
        return _restore_locked(image_dir, manifest, timings, host, port)


def _restore_locked(image_dir: Path, manifest: Manifest, timings: Timings, host: str, port: int) -> RestoredServer:
    control_dir = Path(manifest.control_dir)
    engine_log = control_dir / control.ENGINE_LOG
    restore_log = control_dir / RESTORE_LOG
    with timings.phase("prepare host"):
        other = running_instance(control_dir)
        if other is not None:
            raise ProcessTreeError(other, f"a restored server of this image is already running (pid {other})",
                                   phase="prepare host", hint=f"stop it first (vsnap stop {image_dir}), or capture a second image")
        control.remove_control_files(control_dir)
        # CRIU reopens the log at its captured size: put the captured log back.
        shutil.copy2(image_dir / ENGINE_LOG, engine_log)
        put_back(image_dir / SHM_DIR, manifest.shm_files)
        become_subreaper()
    pid: int | None = None
    restored_pid: list[int] = []
    heartbeat = control.OwnerHeartbeat(control_dir, while_alive=lambda: not restored_pid or alive(restored_pid[0]))
    heartbeat.start()
    try:
        with timings.phase("criu restore"):
            pid = CriuRunner.locate().restore(RestoreOptions(
                images_dir=image_dir / CRIU_DIR, work_dir=control_dir, log_file=restore_log, pidfile=control_dir / RESTORE_PID,
                externals=manifest.externals))
            restored_pid.append(pid)
        if manifest.cuda_processes:
            from ._cuda import CudaCheckpoint

            with timings.phase("cuda restore"):
                cuda = CudaCheckpoint()
                cuda_pids = cuda.cuda_pids(tree_pids(pid))
                if len(cuda_pids) != manifest.cuda_processes:
                    raise ProcessTreeError(pid, f"{len(cuda_pids)} CUDA processes after restore, "
                                                f"{manifest.cuda_processes} at capture", phase="cuda restore")
                cuda.restore(cuda_pids)
        with timings.phase("recover"):
            control.write_message(control_dir, control.ACTIVATION, Activation(host=host, port=port))
            validated = _wait_status(control_dir, pid, ("validated", "serving"), "recover", engine_log)
        with timings.phase("serve"):
            serving = _wait_status(control_dir, pid, ("serving",), "serve", engine_log)
            server = RestoredServer(pid, host, int(serving.detail.get("port", port)), image_dir, control_dir,
                                    engine_log, restore_log)
            health_check(server.url)
    except BaseException:
        heartbeat.stop()
        if pid is not None:
            kill_tree(pid)
        for name in manifest.shm_files:
            (SHM / name).unlink(missing_ok=True)
        raise
    server.heartbeat = heartbeat
    server.timings = dict(timings.seconds)
    t = validated.times
    server.recovery = {k: v for k, v in validated.detail.items() if isinstance(v, (int, float))}
    if "recovered" in t and "oracle_checked" in t:
        server.recovery["oracle_s"] = t["oracle_checked"] - t["recovered"]
    return server


def stop_server(server: RestoredServer | int, grace_s: float = 10.0) -> None:
    """Stop a restored tree: SIGTERM to its root (it shuts the server down), then SIGKILL."""
    if isinstance(server, RestoredServer):
        if server.heartbeat is not None:
            server.heartbeat.stop()
        pid = server.pid
    else:
        pid = server
    kill_tree(pid, grace_s=grace_s)
    reap(pid)


def wait_server(pid: int, poll_s: float = 0.2) -> None:
    """Block until the restored tree's root exits."""
    while alive(pid):
        time.sleep(poll_s)
    reap(pid)
