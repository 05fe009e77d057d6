"""The boot of an engine tree, shared by capture and bench: what it runs (the launch file, the model),
where (an instance directory bound at the control directory, a /dev/shm directory of its own),
with what environment, launched in its namespaces and waited for until it is ready, and how a
launched tree ends.

One boot for both, so that a bench's cold start is the tree a capture checkpoints, minus the
snapshot work: the same launch file (``mode: serve`` instead of ``snapshot``), the same
environment, the same namespaces. A snapshot-mode tree is waited for until it is parked at its
capture barrier (ready.json); a serve-mode tree until it has validated (status.json), when it
takes its listener like a restored one.
"""

from __future__ import annotations

import os
import shutil
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Mapping

from vsnap.host.cleanup import Cleanup
from vsnap.host.events import Timings
from vsnap.host.facts import vllm_device
from vsnap.host.instances import new_instance_dir
from vsnap.host.limits import raise_fd_limit
from vsnap.host.proctree import LaunchedTree, kill_tree, launch_tree
from vsnap.host.shm import instance_shm_dir, remove_instance_shm
from vsnap.host.trust import require_trusted_model
from vsnap.image.manifest import TREE_DIRS
from vsnap.image.store import CONTROL_OUTSIDE_IMAGES, require_outside_images
from vsnap.protocol import control
from vsnap.protocol.control import ErrorReport, LaunchConfig, Ready
from vsnap.protocol.errors import EngineError
from vsnap.spec.schema import ModelSpec

from .bringup import wait_status

DEFAULT_MODEL_ROOT = Path("/var/lib/vsnap/models")
CPU_MODEL_NAME = "cpu-tiny-v1"
VLLM_CACHE_ROOT = "/var/cache/vsnap/vllm"
# the directory that holds the vsnap package, put first on the tree's PYTHONPATH (src/ in a checkout)
PACKAGE_ROOT = Path(__file__).resolve().parents[2]


def resolve_model(spec: ModelSpec) -> Path:
    """The model directory, checked root's alone and resolved (the real path is what the image
    records and the engine reopens); for the cpu engine without one, vsnap writes its tiny model once."""
    if spec.model is not None:
        return require_trusted_model(Path(spec.model))
    directory = DEFAULT_MODEL_ROOT / CPU_MODEL_NAME
    if (directory / "config.json").is_file() and (directory / "model.safetensors").is_file():
        return directory
    from vsnap.engine.adapters.cpu import model as cpu_model  # imports torch: only when the model must be written

    return cpu_model.write_model(directory)


def launch_config(spec: ModelSpec, model_dir: Path, mode: Literal["snapshot", "serve"] = "snapshot") -> LaunchConfig:
    """What the tree builds (launch.json): ``snapshot`` parks it at its capture barrier, ``serve``
    runs the same code without the snapshot work (a bench's cold start)."""
    return LaunchConfig(
        engine=spec.engine, model=str(model_dir), served_model_name=spec.served_model_name,
        serve_args=dict(spec.serve), oracle_prompts=list(spec.oracle.prompts),
        oracle_max_tokens=spec.oracle.max_tokens, oracle_top_k=spec.oracle.top_k,
        oracle_tolerance=spec.oracle.tolerance, timeout_s=spec.snapshot.timeout_s, mode=mode,
        # the GPU path still relies on kernel.io_uring_disabled=2 (checked in preflight) until the
        # filter has been measured there; every CPU tree (the cpu engine, vLLM's CPU backend) gets it
        block_io_uring=spec.engine == "cpu" or vllm_device() == "cpu", **control.stamp(),
    )


def tree_environment(control_dir: Path, instance_dir: Path, engine: str = "cpu") -> dict[str, str]:
    """The tree's environment: the caller's, plus what makes it checkpointable (set by vsnap, not the user).

    ``control_dir`` is the path the tree sees; ``instance_dir`` the host directory bound there
    (a vLLM tree gets the directories of TREE_DIRS there: its IPC sockets, its TMPDIR).
    """
    env = dict(os.environ)
    env.update({"PYTHONUNBUFFERED": "1", "VSNAP_CONTROL_DIR": str(control_dir),
                "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    if engine == "cpu":
        env["OMP_NUM_THREADS"] = "1"
    else:
        for name in TREE_DIRS:
            (instance_dir / name).mkdir(mode=0o700, exist_ok=True)
        if vllm_device() == "cpu":  # not yet run on the GPU path, which keeps io_uring out by sysctl
            env.update({
                "TMPDIR": str(control_dir / "tmp"),  # per instance: vLLM's FileStore and the like never collide
                "USE_LIBUV": "0",  # torch's TCP rendezvous without libuv (which would make an io_uring)
            })
        env.update({
            "VLLM_WORKER_MULTIPROC_METHOD": "spawn",  # fork would copy a CUDA context
            "VLLM_HOST_IP": "127.0.0.1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
            "VLLM_RPC_BASE_PATH": str(control_dir / "rpc"),  # IPC sockets in the per-instance directory
            "NCCL_IB_DISABLE": "1", "NCCL_SOCKET_IFNAME": "lo", "GLOO_SOCKET_IFNAME": "lo",
            "TORCH_NCCL_ENABLE_MONITORING": "0",
            "UV_USE_IO_URING": "0",  # CRIU cannot dump io_uring
        })
        env.setdefault("VLLM_CACHE_ROOT", VLLM_CACHE_ROOT)  # compile cache survives between captures
    src = str(PACKAGE_ROOT)
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


@dataclass(frozen=True)
class TreeInstance:
    """Where one tree runs: its instance id, the host directory bound at the control directory
    inside it (``work``: its launch file, log, status) and the one bound at its /dev/shm."""

    id: str
    work: Path
    shm_dir: Path


def new_tree_instance(control_dir: Path, kind: str, cleanup: Cleanup) -> TreeInstance:
    """A new instance (``kind``: its id's prefix) for a tree with ``control_dir`` as its control
    path. Its /dev/shm directory is removed on every exit; its instance directory on success
    only: a failure keeps it, with the logs its error names."""
    require_outside_images(control_dir, "the control directory", CONTROL_OUTSIDE_IMAGES, itself=True)
    control.ensure_private_dir(control_dir)  # the mount point inside the tree
    instance_id, work = new_instance_dir(control_dir, kind)
    cleanup.on_success(shutil.rmtree, work, True)
    shm_dir = instance_shm_dir(instance_id)
    cleanup.on_exit(remove_instance_shm, shm_dir)
    return TreeInstance(instance_id, work, shm_dir)


@dataclass(frozen=True)
class BootedTree:
    tree: LaunchedTree
    instance: TreeInstance
    env: dict[str, str]  # the tree's whole environment
    launched_at: float  # time.monotonic() just before the launch: where a cold start's clock starts
    ready: Ready | None  # snapshot mode: its ready.json at the barrier; serve mode: None

    @property
    def log(self) -> Path:
        return self.instance.work / control.ENGINE_LOG


def boot_tree(control_dir: Path, instance: TreeInstance, launch: LaunchConfig, cleanup: Cleanup, *,
              env: Mapping[str, str] | None = None, timings: Timings | None = None) -> BootedTree:
    """Boot ``launch`` in ``instance``: its launch file written, its environment (tree_environment,
    then ``env`` over it), the owner heartbeat (a tree whose owner goes silent ends itself), the
    tree launched in its namespaces, then waited for until parked at its capture barrier
    (snapshot mode) or validated (serve mode).

    The phases "launch" and "boot engine" go to ``timings`` when given. The tree's end is
    registered as it starts (launch_tree's ``adopt``): on failure only in snapshot mode (on success
    the dump has ended it), on every exit in serve mode (the caller's block is its life).
    """
    work = instance.work
    control.write_message(work, control.LAUNCH, launch)
    tree_env = {**tree_environment(control_dir, work, launch.engine), **(env or {})}
    heartbeat = control.OwnerHeartbeat(work).start()
    cleanup.on_exit(heartbeat.stop)
    raise_fd_limit()
    end = cleanup.on_exit if launch.mode == "serve" else cleanup.on_failure
    phase = timings.phase if timings is not None else _untimed
    launched_at = time.monotonic()
    with phase("launch"):
        tree = launch_tree(control_dir, work, instance.shm_dir, tree_env,
                           adopt=lambda launched: end(end_launched_tree, launched))
    ready: Ready | None = None
    with phase("boot engine"):
        if launch.mode == "serve":
            wait_status(work, tree.identity, ("validated",), "boot engine", work / control.ENGINE_LOG)
        else:
            ready = wait_ready(tree, work, launch.timeout_s)
    return BootedTree(tree, instance, tree_env, launched_at, ready)


def _untimed(name: str) -> AbstractContextManager[None]:
    return nullcontext()


def wait_ready(tree: LaunchedTree, control_dir: Path, timeout_s: float) -> Ready:
    """The tree's ready.json: it is parked at its capture barrier. The error it reported, or its
    exit before it was ready, fails the boot naming its log."""
    log = control_dir / control.ENGINE_LOG

    def probe() -> Ready | None:
        ready = control.read_message(control_dir, control.READY, Ready)
        if ready is not None:
            return ready
        report = control.read_message(control_dir, control.ERROR, ErrorReport)
        if report is not None:
            raise EngineError(report.phase, report.type, report.message, log_path=log)
        if tree.unshare.poll() is not None:
            raise EngineError("boot engine", "EngineExited",
                              f"the engine tree exited with code {tree.unshare.returncode} before it was ready",
                              log_path=log)
        return None

    return control.wait_until(probe, timeout_s=timeout_s, phase="boot engine", interval_s=0.05, log_path=log)


def end_launched_tree(tree: LaunchedTree) -> None:
    """Kill a launched tree and its `unshare` parent; bounded waits."""
    try:
        kill_tree(tree.identity)
    finally:
        if tree.unshare.poll() is None:
            tree.unshare.kill()
        tree.unshare.wait(timeout=30)
