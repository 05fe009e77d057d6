"""The phases after CRIU, shared by a restore and a standby's activation: CUDA restore onto the
chosen GPUs, recover (the engine reloads its weights and re-runs its oracle), then serve (the
socket handed over, the health check). Also what both watch meanwhile: the tree's status and
errors, and `vsnap stop` asking them to give up.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

from vsnap.engine.adapters.vllm.serve_args import files_read_when_serving
from vsnap.engine.adapters.vllm.serve_args import serves_tls as of_serve
from vsnap.host.criu.runner import LazyPagesServer
from vsnap.host.cuda import CudaCheckpoint
from vsnap.host.events import Timings
from vsnap.host.http import bind_listener, health_check, server_url
from vsnap.host.instances import InstanceRecord, register, stop_requested
from vsnap.host.metrics import write_instance_metrics
from vsnap.host.proctree import ProcessIdentity, in_tree_namespace, is_same, tree_pids
from vsnap.host.trust import require_trusted_file
from vsnap.image.handle import Image
from vsnap.image.manifest import Manifest
from vsnap.protocol import control
from vsnap.protocol.control import Activation, ErrorReport, Status
from vsnap.protocol.errors import CheckpointError, EngineError, OracleMismatch, ProcessTreeError

from .gpus import Gpu, gpu_pairs

RESTORE_LOG = "restore.log"
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


def _vllm_serve(manifest: Manifest) -> dict[str, Any] | None:
    serve = manifest.spec.get("serve") if manifest.engine == "vllm" else None
    return serve if isinstance(serve, dict) else None


def serves_tls(manifest: Manifest) -> bool:
    """Does the image's server speak HTTPS (vLLM's serve.ssl_keyfile / ssl_certfile)?"""
    serve = _vllm_serve(manifest)
    if serve is None:
        return False

    return of_serve(serve)


def require_serving_files(manifest: Manifest) -> None:
    """The files the restored server reads as root when it starts (vLLM's TLS files) are root's
    alone and regular, as at capture (ImageUntrusted naming the file). Not their bytes: a renewed
    certificate is what the server should read."""
    serve = _vllm_serve(manifest)
    if serve is None:
        return

    for argument, path in files_read_when_serving(serve):
        require_trusted_file(Path(path), f"the serve.{argument}")


def _int(value: object) -> int:
    """A number the tree reported (its control files are its to write), -1 when it is none."""
    return value if isinstance(value, int) and not isinstance(value, bool) else -1


def engine_failure(report: ErrorReport, log: Path) -> EngineError:
    if report.type == "OracleMismatch":
        d = report.detail
        return OracleMismatch(_int(d.get("prompt")), _int(d.get("position")), str(d.get("expected", "?"))[:200],
                              str(d.get("actual", "?"))[:200], log_path=log)
    return EngineError(report.phase[:100], report.type[:100], report.message[:2000], log_path=log)  # the tree's words, cut


def wait_status(control_dir: Path, tree: ProcessIdentity, want: tuple[str, ...], phase: str, log: Path) -> Status:
    def probe() -> Status | None:
        report = control.read_message(control_dir, control.ERROR, ErrorReport)
        if report is not None:
            raise engine_failure(report, log)
        status = control.read_message(control_dir, control.STATUS, Status)
        if status is not None and status.state in want:
            return status
        if not is_same(tree):
            raise EngineError(phase, "EngineExited", "the restored engine exited without reporting why", log_path=log)
        return None

    return control.wait_until(probe, timeout_s=RECOVER_TIMEOUT_S, phase=phase, interval_s=0.005, log_path=log)


@contextmanager
def handed_over_listener(work: Path, tree: ProcessIdentity, host: str, port: int, log: Path) -> Iterator[int]:
    """Bind host:port here, pass the socket into the validated tree, wait until it says it serves;
    yield the port bound (the one asked for, or the one the kernel chose for 0: never what the tree
    says). vsnap's own copy of the socket stays open until the block ends: if the tree drops its
    copy (uvicorn failing on its TLS files, say), the port stays bound, and no one else's server
    can answer the health check in the tree's place."""
    with bind_listener(host, port) as listener:
        control.send_listener(work, listener, peer_allowed=lambda pid: in_tree_namespace(pid, tree))
        wait_status(work, tree, ("serving",), "serve", log)
        yield int(listener.getsockname()[1])


def tree_failure(work: Path, tree: ProcessIdentity, log: Path) -> EngineError | None:
    """Why the tree can no longer be serving: the error it reported, or that it is gone; None if neither."""
    report = control.read_message(work, control.ERROR, ErrorReport)
    if report is not None:
        return engine_failure(report, log)
    if not is_same(tree):
        return EngineError("serve", "EngineExited", "the restored engine exited before /health answered", log_path=log)
    return None


def check_stop(work: Path) -> None:
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
class RestoredTree:
    """A tree CRIU restored, on its way to serving: what the phases after CRIU need."""

    image: Image  # open, its readers' lock held until the engine has read the weights
    work: Path  # its instance directory
    identity: ProcessIdentity
    record: InstanceRecord

    @property
    def engine_log(self) -> Path:
        return self.work / control.ENGINE_LOG


def bring_up(tree: RestoredTree, host: str, port: int, targets: list[Gpu] | None, timings: Timings) -> RestoredServer:
    """CUDA restore (onto ``targets``, one GPU per rank), recover (weights, oracle), then serve on
    host:port: the phases after CRIU, shared by a restore and a standby's activation. The image's
    readers' lock is released once the engine has read the weights."""
    manifest, work, identity, engine_log = tree.image.manifest, tree.work, tree.identity, tree.engine_log
    if manifest.cuda_processes:
        with timings.phase("cuda restore"):
            cuda = CudaCheckpoint()
            cuda_pids = cuda.cuda_pids(tree_pids(identity.pid))
            if len(cuda_pids) != manifest.cuda_processes:
                raise ProcessTreeError(identity.pid, f"{len(cuda_pids)} CUDA processes after restore, "
                                                     f"{manifest.cuda_processes} at capture", phase="cuda restore")
            cuda.restore(cuda_pids, gpu_pairs=gpu_pairs(manifest.captured_gpus(), targets))
        check_stop(work)
    with timings.phase("recover"):
        control.write_message(work, control.ACTIVATION, Activation(
            host=host, port=port, weights_dir=str(tree.image.weights_dir) if tree.image.weights_dir.is_dir() else None,
            **control.stamp()))
        validated = wait_status(work, identity, ("validated",), "recover", engine_log)
    tree.image.release()  # the engine has read the image's weights: a capture may replace it now
    check_stop(work)
    with timings.phase("serve"):
        started = time.monotonic()
        with handed_over_listener(work, identity, host, port, engine_log) as bound:
            handed_over = time.monotonic()
            server = RestoredServer(identity.pid, host, bound, tree.image.path, tree.record.id, work,
                                    gpu=",".join(t.uuid for t in targets) if targets else None,
                                    identity=identity, tls=serves_tls(manifest))
            health_check(server.url, stop=lambda: tree_failure(work, identity, engine_log))
        serve_split = {"socket_handoff_s": handed_over - started, "http_start_s": time.monotonic() - handed_over}
        failure = tree_failure(work, identity, engine_log)  # it answered; is it still the tree, serving?
        if failure is not None:
            raise failure
    check_stop(work)
    metrics = write_instance_metrics(tree.record.id, manifest.name, "restored", timings.seconds)
    register(tree.record.model_copy(update={"state": "serving", "url": server.url, "port": server.port,
                                            "gpu": server.gpu, "activator": None,
                                            "timings": dict(timings.seconds),
                                            "metrics_dir": str(metrics.parent) if metrics else ""}))
    t = validated.times
    server.recovery = {k: v for k, v in validated.detail.items() if isinstance(v, (int, float))}
    server.weights_source = validated.detail.get("weights_source")
    if "recovered" in t and "oracle_checked" in t:
        server.recovery["oracle_s"] = t["oracle_checked"] - t["recovered"]
    server.recovery.update(serve_split)  # the serve phase: socket handoff, then the server's own start
    return server
