"""capture_image(): boot the engine tree to its barrier, checkpoint it with CRIU, publish the image.

Phases: preflight, prepare model, launch, boot engine (to ready.json), cuda checkpoint (vLLM on
CUDA), criu dump, publish; capture_image reads as them, one function each. The boot is
ops/tree's, the one a bench's cold start uses too. On every exit path that is not success the
tree is killed, the staging directory removed, and no image appears under the final name (an
older image there stays untouched).
"""

from __future__ import annotations

import datetime as _dt
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vsnap.engine.adapters.vllm.rules import tensor_parallel_size as of_serve
from vsnap.host import cuda as cuda_driver
from vsnap.host import verified
from vsnap.host.cleanup import Cleanup
from vsnap.host.criu.options import DumpOptions, external_mounts
from vsnap.host.criu.runner import CriuRunner
from vsnap.host.cuda import CudaCheckpoint, gpu_memory_by_pid
from vsnap.host.events import ProgressCallback, Timings
from vsnap.host.facts import host_facts, require_host, vllm_device
from vsnap.host.instances import CaptureRecord, prune_dead_runs, register_capture, this_process, unregister_capture
from vsnap.host.netns import NETNS_KEY, netns_inode
from vsnap.host.paths import require_runtime_dir, require_safe_directory
from vsnap.host.proctree import LaunchedTree, is_same, mapped_and_open_files, open_device_files, tree_pids, wait_gone
from vsnap.host.shm import SHM, tree_shm_files
from vsnap.host.trust import (copy_no_follow, make_trusted_dirs, model_file_paths, require_trusted_ancestors,
                              require_trusted_model)
from vsnap.image.manifest import (
    CRIU_DIR,
    DUMP_LOG,
    ENGINE_LOG,
    FORMAT_VERSION,
    MANIFEST,
    SHM_DIR,
    TREE_DIRS,
    WEIGHTS_DIR,
    Dependency,
    FileEntry,
    HostFacts,
    ImageLaunch,
    Manifest,
)
from vsnap.image.store import (
    CONTROL_OUTSIDE_IMAGES,
    HASH_THREADS,
    check_parent,
    checksum_tree,
    image_lock,
    image_read_lock,
    make_staging,
    publish,
    remove_stale_staging,
    require_outside_images,
    require_replaceable,
    sha256_file,
)
from vsnap.protocol import control
from vsnap.protocol.control import LaunchConfig, Ready
from vsnap.protocol.errors import CheckpointError, CriuError, HostNotReady, ImageError, ProcessTreeError
from vsnap.protocol.version import PROTOCOL_VERSION
from vsnap.spec.schema import ModelSpec
from vsnap.spec.vllm_check import require_supported_args

from . import resources
from .tree import BootedTree, boot_tree, launch_config, new_tree_instance, resolve_model


@dataclass(frozen=True)
class CaptureResult:
    image_dir: Path
    manifest: Manifest
    timings: dict[str, float]
    image_bytes: int
    engine_log: Path


def capture_image(spec: ModelSpec, *, image_dir: Path | None = None, force: bool = False,
                  env: dict[str, str] | None = None, on_event: ProgressCallback | None = None) -> CaptureResult:
    """Boot ``spec``'s engine, checkpoint it at the barrier and publish the image (``env``: more
    environment for the tree, e.g. a compile cache).

    What may stand at the image path is checked before the boot (nothing, or with ``force`` a
    vsnap image: never a link or an ordinary directory). Every resource is released on every exit
    path (host/cleanup): the tree, the staging directory, the tree's /dev/shm directory, the record.
    """
    image_dir = Path(image_dir or spec.image_dir).absolute()
    timings = Timings(on_event)
    runner = _preflight(spec, image_dir, force, timings)
    prune_dead_runs()
    with image_lock(image_dir), Cleanup() as cleanup:
        require_replaceable(image_dir, force)  # again, now that we hold the lock
        remove_stale_staging(image_dir)
        boot = _boot(spec, image_dir, env, cleanup, timings)
        found = _survey(boot)
        frozen = _checkpoint(boot, found, timings)
        _dump(runner, boot, found, frozen, timings)
        shm_files = _write_image(boot)
        manifest, image_bytes = _publish(boot, found, frozen, shm_files, timings)
    return CaptureResult(image_dir, manifest, dict(timings.seconds), image_bytes, image_dir / ENGINE_LOG)


def _preflight(spec: ModelSpec, image_dir: Path, force: bool, timings: Timings) -> CriuRunner:
    """Everything that can refuse the capture before anything is made or booted; the CRIU to dump with."""
    with timings.phase("preflight"):
        require_runtime_dir()
        require_safe_directory(str(image_dir), "the image")
        require_host(spec.engine)
        runner = CriuRunner.locate()
        require_outside_images(spec.control_dir, "the control directory", CONTROL_OUTSIDE_IMAGES, itself=True)
        check_parent(image_dir)  # makes the image's missing parents: after the control directory's refusal
        require_trusted_ancestors(spec.control_dir)
        require_replaceable(image_dir, force)
        if spec.model is not None:
            require_trusted_model(Path(spec.model))  # before the boot; resolve_model checks again
        if spec.engine == "vllm":
            require_supported_args(spec)
        model_dir = Path(spec.model) if spec.model is not None else None
        resources.require(resources.capture_needs(spec, model_dir, image_dir, resources.capture_gpus(spec)), "capture")
    return runner


@dataclass(frozen=True)
class Boot:
    """A capture's tree, parked at its barrier, and what its boot settled."""

    spec: ModelSpec
    image_dir: Path
    staging: Path  # the image being written, published under image_dir at the end
    model_dir: Path
    launch: LaunchConfig
    tp: int  # ranks, one GPU each on CUDA
    cuda: bool  # vLLM on CUDA: the GPU state goes through a CUDA checkpoint
    booted: BootedTree
    ready: Ready  # what the tree wrote at its barrier (its oracle among it)

    @property
    def tree(self) -> LaunchedTree:
        return self.booted.tree

    @property
    def work(self) -> Path:
        """This capture's instance directory, bound at the control directory inside the tree."""
        return self.booted.instance.work


def _boot(spec: ModelSpec, image_dir: Path, extra_env: dict[str, str] | None, cleanup: Cleanup,
          timings: Timings) -> Boot:
    """The tree booted to its barrier (ops/tree), with what a capture adds before the launch: its
    staging directory (removed on failure), its record (a later run clears what a killed capture
    left: the staging and /dev/shm directories), the weights file the engine writes into the
    staging directory (vLLM on CUDA, ``snapshot.weights: image``), the GPUs the ranks run on."""
    with timings.phase("prepare model"):
        model_dir = resolve_model(spec)
    control_dir = spec.control_dir
    make_trusted_dirs(control_dir)
    instance = new_tree_instance(control_dir, "capture", cleanup)  # bound there: this capture's files
    staging = make_staging(image_dir)
    cleanup.on_failure(shutil.rmtree, staging, True)
    register_capture(CaptureRecord(id=instance.id, owner=this_process(), image=str(image_dir),
                                   staging=str(staging), shm_dir=str(instance.shm_dir), started_at=time.time()))
    cleanup.on_exit(unregister_capture, instance.id)
    launch = launch_config(spec, model_dir)
    cuda = spec.engine == "vllm" and vllm_device() == "cuda"
    if cuda and spec.snapshot.weights == "image":  # the engine writes it
        launch = launch.model_copy(update={"weights_dir": str(staging / WEIGHTS_DIR)})
    tp = tensor_parallel_size(spec)
    env = dict(extra_env or {})
    if cuda:
        env = gpu_environment(env, tp)
    booted = boot_tree(control_dir, instance, launch, cleanup, env=env, timings=timings)
    assert booted.ready is not None  # snapshot mode: boot_tree waited for ready.json
    return Boot(spec, image_dir, staging, model_dir, launch, tp, cuda, booted, booted.ready)


def gpu_environment(env: dict[str, str], tp: int) -> dict[str, str]:
    """``env`` with the GPUs the ranks run on: CUDA_VISIBLE_DEVICES as the caller gave it (in
    ``env``, else in vsnap's own environment, which the tree inherits), else the first ``tp`` GPUs
    by UUID; at least one GPU per rank either way."""
    visible = env.get("CUDA_VISIBLE_DEVICES", os.environ.get("CUDA_VISIBLE_DEVICES"))
    if visible is None:
        visible = ",".join(capture_gpu_uuids(tp))
    require_visible_gpus(visible, tp)
    return {**env, "CUDA_VISIBLE_DEVICES": visible}


@dataclass(frozen=True)
class TreeFacts:
    """What the image records of the parked tree and its host, gathered before anything is frozen."""

    pids: list[int]
    dependencies: list[Dependency]
    externals: dict[str, str]  # CRIU's external mounts: key -> mount point
    control_key: str
    shm_key: str
    facts: HostFacts
    gpu_uuids: list[str]  # rank order; empty off CUDA


def _survey(boot: Boot) -> TreeFacts:
    """The tree's processes, the host files it depends on, its external mounts (the control
    directory and /dev/shm, which a restore binds again), the host's facts and the ranks' GPUs."""
    tree, spec, tp = boot.tree, boot.spec, boot.tp
    pids = tree_pids(tree.root_pid)
    dependencies = _dependencies(pids, boot.model_dir, spec.control_dir)
    with open(f"/proc/{tree.root_pid}/mountinfo") as f:
        externals = external_mounts(f.read())
    control_key = next((k for k, mountpoint in externals.items() if mountpoint == str(spec.control_dir)), None)
    shm_key = next((k for k, mountpoint in externals.items() if mountpoint == str(SHM)), None)
    if control_key is None or shm_key is None:
        raise ProcessTreeError(tree.root_pid, f"the tree lacks its mounts at {spec.control_dir} and {SHM}",
                               phase="boot engine", log_path=boot.work / control.ENGINE_LOG)
    env = boot.booted.env
    facts = host_facts(spec.engine, visible=recorded_visible(env))
    gpu_uuids = [str(g["uuid"]) for g in facts.gpus[:tp]] if boot.cuda else []  # rank order
    if boot.cuda and len(gpu_uuids) < tp:
        raise HostNotReady("gpu", f"CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES'][:200]!r}: vsnap finds "
                                  f"{len(gpu_uuids)} of the {tp} GPU(s) the ranks run on by UUID or index",
                           hint="name the GPUs by UUID (nvidia-smi -L), or unset it (vsnap takes the first)")
    if boot.cuda:
        require_one_gpu_model(facts.gpus[:tp])
    return TreeFacts(pids, dependencies, externals, control_key, shm_key, facts, gpu_uuids)


@dataclass(frozen=True)
class Frozen:
    """The tree ready for CRIU: the processes whose CUDA state was checkpointed, and each process
    as CRIU will write it (its anonymous memory, and the GPU memory the CUDA checkpoint moved)."""

    cuda_pids: list[int]
    processes: list[dict[str, Any]]


def _checkpoint(boot: Boot, found: TreeFacts, timings: Timings) -> Frozen:
    """The tree checked still parked, then (vLLM on CUDA) its GPU state moved into its host memory
    by the CUDA checkpoint, with no GPU device file left open for CRIU to trip on."""
    (boot.staging / CRIU_DIR).mkdir()
    (boot.staging / "logs").mkdir()
    cuda_pids: list[int] = []
    gpu_bytes: dict[int, int] = {}
    require_parked(boot.tree, boot.work, boot.ready)
    if boot.cuda:
        gpu_bytes = gpu_memory_by_pid()  # what each process's CUDA checkpoint will move
        with timings.phase("cuda checkpoint"):
            cuda = CudaCheckpoint()
            cuda_pids = cuda.cuda_pids(found.pids)
            cuda.checkpoint(cuda_pids)
            require_no_gpu_files(found.pids, boot.work)
    processes = [{**process_memory(pid), **({"gpu_bytes": gpu_bytes[pid]} if pid in gpu_bytes else {})}
                 for pid in found.pids]  # after the CUDA checkpoint: what CRIU writes
    return Frozen(cuda_pids, processes)


def _dump(runner: CriuRunner, boot: Boot, found: TreeFacts, frozen: Frozen, timings: Timings) -> None:
    """CRIU writes the tree into the staging directory and the tree ends with the dump."""
    tree, staging, work = boot.tree, boot.staging, boot.work
    with timings.phase("criu dump"):
        require_space(staging, frozen.processes)
        require_parked(tree, work, boot.ready)
        try:
            runner.dump(DumpOptions(pid=tree.root_pid, images_dir=staging / CRIU_DIR,
                                    log_file=staging / DUMP_LOG, externals=found.externals,
                                    external_netns=(netns_inode(tree.root_pid), NETNS_KEY)))
        except CriuError as error:
            raise dump_failure(error, staging, work) from None
        left = wait_gone(found.pids, 30)
        if left:
            raise ImageError(f"processes {left} of the tree survived the dump")
        tree.unshare.wait(timeout=30)
        # what the image holds is the tree as it was at the dump: nothing may have reached
        # its control directory until then (an activation read just before the freeze)
        require_parked_files(work)


def _write_image(boot: Boot) -> list[str]:
    """Beside CRIU's files: the files the tree left in its /dev/shm (moved into the image) and the
    engine's log; the names of the /dev/shm files."""
    shm_dir, staging = boot.booted.instance.shm_dir, boot.staging
    shm_files = tree_shm_files(shm_dir)
    if shm_files:
        (staging / SHM_DIR).mkdir()
        for name in shm_files:  # sparse copies: vLLM's shared-memory rings are mostly holes
            copy_no_follow(shm_dir / name, staging / SHM_DIR / name)
            os.unlink(shm_dir / name)
    shutil.copy2(boot.work / control.ENGINE_LOG, staging / ENGINE_LOG)
    return shm_files


def _publish(boot: Boot, found: TreeFacts, frozen: Frozen, shm_files: list[str],
             timings: Timings) -> tuple[Manifest, int]:
    """Every file hashed into the manifest, the staging directory renamed to the image's name once
    no restore reads the old image there; the manifest and the image's size."""
    staging, image_dir = boot.staging, boot.image_dir
    with timings.phase("publish"):
        files = checksum_tree(staging)
        image_bytes = sum(entry.size for entry in files.values())
        manifest = _manifest(boot, found, frozen, shm_files, files, timings)
        control.write_atomic(staging, MANIFEST, manifest.model_dump_json(indent=2).encode())
        with image_read_lock(image_dir, exclusive=True):  # no restore is reading the old image
            publish(staging, image_dir)
        # just hashed: the first restore need not hash the files again
        verified.remember(image_dir, {rel: (os.lstat(image_dir / rel), entry.digest)
                                      for rel, entry in files.items()})
    return manifest, image_bytes


def _manifest(boot: Boot, found: TreeFacts, frozen: Frozen, shm_files: list[str], files: dict[str, FileEntry],
              timings: Timings) -> Manifest:
    """The image's manifest (the timings: the phases so far, publish not yet among them)."""
    spec, ready, facts = boot.spec, boot.ready, found.facts
    return Manifest(
        format_version=FORMAT_VERSION, protocol_version=PROTOCOL_VERSION,
        vsnap_version=facts.vsnap,
        created_at=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        name=spec.name, engine=spec.engine, spec=spec.model_dump(mode="json"),
        launch=ImageLaunch.of(boot.launch),
        control_dir=str(spec.control_dir), control_mount_key=found.control_key, shm_mount_key=found.shm_key,
        netns_key=NETNS_KEY, oracle=ready.oracle, host=facts,
        externals=found.externals, shm_files=shm_files, cuda_processes=len(frozen.cuda_pids),
        tensor_parallel_size=boot.tp, gpu_uuids=found.gpu_uuids,
        gpu_memory_required=gpu_memory_required(spec, facts), dependencies=found.dependencies,
        timings={**timings.seconds, "engine_boot_to_ready": ready.times.get("prepared", 0)
                 - ready.times.get("start", 0)},
        sizes={"image_bytes": sum(entry.size for entry in files.values()),
               "criu_bytes": sum(e.size for k, e in files.items() if k.startswith(CRIU_DIR + "/"))},
        files=files, processes=frozen.processes,
    )


def _dependencies(pids: list[int], model_dir: Path, control_dir: Path) -> list[Dependency]:
    """Every host file the tree has mapped or open, and the model's files (reloaded at recover),
    with size and sha256: what another host must have, byte for byte, to restore this image."""
    paths = {p for p in mapped_and_open_files(pids) if not p.startswith(str(control_dir) + "/")}
    paths |= {str(p) for p in model_file_paths(model_dir)}
    ordered = sorted(paths)
    statted_at = time.time_ns()
    before = {path: os.stat(path) for path in ordered}
    with ThreadPoolExecutor(max_workers=HASH_THREADS) as pool:
        digests = list(pool.map(lambda path: sha256_file(Path(path), before[path].st_size), ordered))
    # a restore on this host compares the sha256 of each without reading it again (host.verified)
    verified.remember_dependencies({path: (before[path], digest) for path, digest in zip(ordered, digests)},
                                   statted_at_ns=statted_at)
    return [Dependency(path=path, size=before[path].st_size, sha256=digest) for path, digest in zip(ordered, digests)]


def process_memory(pid: int, top: int = 6) -> dict[str, Any]:
    """A process's command, anonymous memory (about what CRIU writes into its pages-*.img) and its
    largest anonymous mappings (to see what fills an image)."""
    anonymous, mappings, header = 0, [], ""
    try:
        with open(f"/proc/{pid}/smaps") as f:
            for line in f:
                if line[:1] in "0123456789abcdef" and "-" in line.split(" ", 1)[0]:
                    header = line
                elif line.startswith("Anonymous:"):
                    size = int(line.split()[1]) * 1024
                    anonymous += size
                    if size:
                        fields = header.split()
                        mappings.append({"bytes": size, "perms": fields[1] if len(fields) > 1 else "?",
                                         "name": fields[5] if len(fields) > 5 else "[anon]"})
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            command = f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:200]
    except OSError:
        return {"pid": pid, "command": "?", "anonymous_bytes": 0, "largest_mappings": []}
    mappings.sort(key=lambda m: -m["bytes"])
    return {"pid": pid, "command": command, "anonymous_bytes": anonymous, "mappings": len(mappings),
            "largest_mappings": mappings[:top]}


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def require_space(staging: Path, processes: list[dict[str, Any]]) -> None:
    """Refuse before dumping when the image cannot fit on its disk."""
    need, free = sum(int(p["anonymous_bytes"]) for p in processes), free_bytes(staging)
    if need > free:
        raise CheckpointError(
            f"not enough space for the image on the disk holding {staging.parent}: "
            f"about {need / 1e6:.0f} MB needed, {free / 1e6:.0f} MB free",
            phase="criu dump", hint="free space there, or capture with --image on another disk")


def dump_failure(error: CriuError, staging: Path, control_dir: Path) -> CheckpointError:
    """Keep the dump log outside the staging directory (which is removed) and name a full disk."""
    kept = control_dir / "dump-failed.log"
    try:
        shutil.copyfile(staging / DUMP_LOG, kept)
        error.log_path = str(kept)
    except OSError:
        pass
    if free_bytes(staging) < 16 << 20:
        return CheckpointError(f"the disk holding {staging.parent} filled up while CRIU wrote the image "
                               f"({free_bytes(staging) / 1e6:.0f} MB free)", phase="criu dump",
                               hint="free space there, or capture with --image on another disk",
                               log_path=error.log_path)
    return error


# What a tree parked at its barrier may have in its control directory: what vsnap wrote (the
# launch file, the owner heartbeat and its temp files) and what the engine writes before the
# barrier (ready.json, its log, vLLM's IPC sockets under rpc/). Anything else (an activation,
# a status, an error, a file of unknown origin) means the tree may have gone past its barrier.
PARKED_FILES = frozenset({control.LAUNCH, control.READY, control.OWNER, control.ENGINE_LOG})
PARKED_DIRS = frozenset(TREE_DIRS)


def require_parked(tree: LaunchedTree, work: Path, ready: Ready) -> None:
    """The tree is still the one launched, alive, and parked at its barrier (see PARKED_FILES)."""
    log = work / control.ENGINE_LOG
    if not is_same(tree.identity):
        raise ProcessTreeError(tree.root_pid, "the engine tree exited at its capture barrier", phase="criu dump",
                               log_path=log)
    require_parked_files(work)
    if control.read_message(work, control.READY, Ready) != ready:
        raise CheckpointError(f"{work / control.READY} changed after the tree reached its barrier", phase="criu dump",
                              hint="capture again; nothing was published", log_path=log)


def require_parked_files(work: Path) -> None:
    """Nothing in the control directory but what a parked tree has (checked before the CUDA
    checkpoint, before the dump and after it: the image holds the tree as it was at the freeze)."""
    for entry in sorted(os.scandir(work), key=lambda e: e.name):
        parked = (entry.name in PARKED_FILES and entry.is_file(follow_symlinks=False)) or \
            (entry.name in PARKED_DIRS and entry.is_dir(follow_symlinks=False)) or \
            (entry.name.startswith(f".{control.OWNER}.") and entry.name.endswith(".tmp"))  # a heartbeat write
        if not parked:
            raise CheckpointError(
                f"{entry.path} appeared in the capturing tree's control directory; only vsnap writes there, and the "
                "tree may have gone past its barrier", phase="criu dump", log_path=work / control.ENGINE_LOG,
                hint="capture again, and let nothing else write into the control directory; nothing was published")


def tensor_parallel_size(spec: ModelSpec) -> int:
    """How many GPUs (worker processes) the spec's engine runs on."""
    if spec.engine != "vllm":
        return 1

    return max(of_serve(dict(spec.serve)), 1)


def capture_gpu_uuids(tp: int = 1) -> list[str]:
    """The GPUs a vLLM capture runs on when CUDA_VISIBLE_DEVICES does not say: the first ``tp``,
    in CUDA ordinal order (rank r on the r-th)."""
    _, _, gpus = cuda_driver.gpu_facts()
    if not gpus:
        raise HostNotReady("gpu", "no CUDA GPU is visible", hint="check nvidia-smi")
    if len(gpus) < tp:
        raise HostNotReady("gpu", f"tensor_parallel_size {tp} needs {tp} GPUs; this host has {len(gpus)}",
                           required=f"{tp} GPUs", found=str(len(gpus)),
                           hint="capture on a host with enough GPUs, or lower tensor_parallel_size")
    require_one_gpu_model(gpus[:tp])
    return [str(g["uuid"]) for g in gpus[:tp]]


def require_one_gpu_model(gpus: list[dict]) -> None:
    """The ranks' GPUs are all one model: a restore checks every rank's GPU against the captured
    model (the manifest's first GPU), and vLLM sizes the KV cache of every rank alike."""
    names = list(dict.fromkeys(str(g.get("name")) for g in gpus))
    if len(names) > 1:
        raise HostNotReady("gpu", f"the ranks' GPUs are of different models ({', '.join(names)})",
                           hint="give every rank a GPU of one model (CUDA_VISIBLE_DEVICES with their UUIDs)")


def require_visible_gpus(visible: str, tp: int) -> None:
    """CUDA_VISIBLE_DEVICES (the caller's, when it gave one) names at least one GPU per rank."""
    named = [v for v in visible.split(",") if v.strip()]
    if len(named) < tp:
        raise HostNotReady("gpu", f"CUDA_VISIBLE_DEVICES={visible!r} names {len(named)} GPU(s); tensor_parallel_size "
                                  f"{tp} needs {tp}", required=f"{tp} GPUs", found=str(len(named)),
                           hint="name one GPU per rank in CUDA_VISIBLE_DEVICES, or unset it (vsnap takes the first)")


def recorded_visible(env: dict[str, str]) -> str | None:
    """The CUDA_VISIBLE_DEVICES value host_facts picks the tree's GPUs by: none when vsnap itself
    runs under the same value (the caller's), since its own CUDA enumeration is then exactly the
    tree's, in the tree's order, while an index in the value counts the host's GPUs, not vsnap's
    (CUDA_VISIBLE_DEVICES=1,0 on a two-GPU host would record rank 0 on GPU 0)."""
    visible = env.get("CUDA_VISIBLE_DEVICES")
    return None if visible == os.environ.get("CUDA_VISIBLE_DEVICES") else visible


def require_no_gpu_files(pids: list[int], work: Path) -> None:
    """After the CUDA checkpoint no process of the tree may hold a GPU device file open: CRIU cannot
    dump one, and would fail with a less clear error (NVML, which NCCL opens, is the likely holder)."""
    held = open_device_files(pids)
    if held:
        pid, files = next(iter(sorted(held.items())))
        command = process_memory(pid, top=0)["command"] or "?"
        others = f" (and {len(held) - 1} more processes)" if len(held) > 1 else ""
        raise ProcessTreeError(pid, f"{', '.join(files)} still open after the CUDA checkpoint in pid {pid} "
                                    f"({command[:80]}){others}: CRIU cannot dump a GPU device file",
                               phase="cuda checkpoint",
                               log_path=work / control.ENGINE_LOG,
                               hint="NVML or a CUDA context the checkpoint does not cover holds it; see "
                                    "docs/troubleshooting.md (GPU device file still open); nothing was published")


def gpu_memory_required(spec: ModelSpec, facts: HostFacts) -> int | None:
    """GPU memory a restore needs free: vLLM takes gpu_memory_utilization of the GPU once awake."""
    if spec.engine != "vllm" or not facts.gpus:
        return None
    return int(resources.memory_share(spec.serve.get("gpu_memory_utilization")) * int(facts.gpus[0]["memory_bytes"]))


