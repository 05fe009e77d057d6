"""restore_image(): verify, CRIU restore, activate, wait for the oracle, health check.

Phases: verify image, prepare host, criu restore, recover (the engine reloads its weights and
re-runs the oracle), serve (bind and health check). Any failure or interrupt from CRIU's start on
ends CRIU and the tree it restored, so nothing is left running.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from vsnap.host import gpu_early
from vsnap.host.cleanup import Cleanup
from vsnap.host.criu.options import LazyPagesOptions, RestoreOptions
from vsnap.host.criu.runner import CriuRunner, LazyPagesServer
from vsnap.host.events import ProgressCallback, Timings, failpoint
from vsnap.host.facts import check_criu_this_boot, check_root
from vsnap.host.privileges import check_privileges
from vsnap.host.http import check_port_free
from vsnap.host.limits import raise_fd_limit
from vsnap.host.instances import (
    InstanceRecord,
    ProcessRef,
    left_by_restore,
    new_instance_dir,
    pidfile_dir,
    pidfile_of,
    prune_dead_runs,
    register,
    this_process,
    unregister,
)
from vsnap.host.netns import NetnsHolder
from vsnap.host.paths import require_runtime_dir
from vsnap.host.proctree import (
    ProcessIdentity,
    become_subreaper,
    identify,
    identify_restored_root,
    is_same,
    kill_tree,
    our_children,
    reap,
    tree_memory_bytes,
    wait_gone,
)
from vsnap.host.shm import instance_shm_dir, put_back, remove_instance_shm
from vsnap.host.trust import copy_no_follow, make_trusted_dirs
from vsnap.host.verified import VERIFIED_DIR
from vsnap.image.compat import HostDifference, current_facts
from vsnap.image.handle import Image, open_image
from vsnap.image.manifest import TREE_DIRS, Manifest
from vsnap.image.store import require_recorded_control_dir
from vsnap.protocol import control
from vsnap.protocol.control import Standby
from vsnap.protocol.errors import EngineError, HostNotReady, UnsupportedOption, VsnapError

from . import resources
from .bringup import RESTORE_LOG, CheckClock, RestoredServer, RestoredTree, bring_up, check_stop, require_serving_files
from .gpus import Gpu, choose_gpus, require_gpu_state, shown

LAZY_PAGES_LOG = "lazy-pages.log"
# VSNAP_FAILPOINT: SIGKILL this process while CRIU restores ("stall ...": hold it there while CRIU goes on)
CRIU_RUNNING_FAILPOINT = "inside criu restore"


def restore_pidfile(instance_id: str) -> Path:
    """Where CRIU writes the restored root's PID: a directory of root's alone (make_trusted_dirs),
    not the instance directory, which the restored tree sees as its control directory and could
    rewrite before vsnap reads it (CriuRunner.restore reads it once and removes it; if this process
    dies while CRIU runs, host.instances adopts the tree it names and prune_dead_runs removes it)."""
    control.ensure_private_dir(make_trusted_dirs(pidfile_dir()))
    return pidfile_of(instance_id)


def verify_image(image_dir: Path, *, rehash: bool = False) -> Manifest:
    """Everything a restore checks before CRIU starts: trust, manifest, every file's sha256, this host,
    under the image's readers' lock as a restore holds it (ImageUntrusted for an image that is not
    root's alone, ImageBusy while a capture replaces it: since session 12, as a restore refuses them).

    Files this host hashed before and that did not change since are not hashed again (see
    host.verified) unless ``rehash``.
    """
    with open_image(image_dir) as image:
        image.verify_files(rehash=rehash)
        image.require_fits_host()
        return image.manifest


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


def restore_image(image_dir: Path, *, host: str = "127.0.0.1", port: int = 8000, gpu: str | None = None,
                  rehash: bool = False, lazy_pages: bool = False, standby: bool = False,
                  on_event: ProgressCallback | None = None) -> RestoredServer:
    """Restore a new instance of the image's tree, activate it on host:port and return once it serves.

    Each call gets its own instance directory, PID namespace and (for vLLM) GPU: ``gpu`` is an
    index or UUID (a tensor-parallel image: one per rank, comma-separated); by default the
    captured GPU if present, else the first of the same model with enough free memory. ``rehash``:
    hash every image file even if this host verified it before. ``lazy_pages``: CRIU maps the
    tree's memory and a `criu lazy-pages` server fills it on first touch (then pushes the rest), so
    CRIU returns sooner. ``standby``: stop after CRIU restored the tree, its CUDA state still
    checkpointed (no GPU memory, no port): `activate_instance` serves it.

    Before anything runs, the image must pass the trust model (host.trust: root's alone, every
    path inside it) and its files must match the manifest; the image's readers' lock is held from
    then until the engine has read the image's weights, so a capture cannot replace it meanwhile
    (a standby's activation takes it again and checks the image is still the one restored).
    Every resource is released on every failure (host.cleanup); the instance directory stays, with
    the logs the error names.
    """
    timings = Timings(on_event)
    _require_options(gpu, lazy_pages=lazy_pages, standby=standby)
    clock = CheckClock()
    host_warnings: list[HostDifference] = []
    with Cleanup() as cleanup, ExitStack() as reading, ExitStack() as noting:
        noting.push(_note_host_differences(host_warnings))
        with timings.phase("verify image"):
            check_root()
            require_runtime_dir()  # the records and caches it writes (the CLI checked it too)
            image = reading.enter_context(open_image(image_dir))  # before a byte of the image is read
            checked = _verify(image, host, port, gpu, clock, rehash=rehash, lazy_pages=lazy_pages, standby=standby)
            host_warnings += checked.warnings  # differences that do not stop a restore
        prune_dead_runs()
        with timings.phase("prepare host"):
            raise_fd_limit()  # CRIU needs room for its own descriptors, whatever the calling shell had
            instance = _prepare_host(image, cleanup, standby=standby)
        restored: list[ProcessIdentity] = []
        heartbeat = control.OwnerHeartbeat(instance.work, while_alive=lambda: not restored or is_same(restored[0]))
        heartbeat.start()
        cleanup.on_failure(heartbeat.stop)
        check_stop(instance.work)
        with timings.phase("criu restore"):
            tree, lazy = _criu_restore(image, instance, cleanup, lazy_pages=lazy_pages)
            restored.append(tree.identity)
        check_stop(instance.work)
        if standby:
            image.release()  # CRIU has read its pages; the activation locks the image again for the weights
            register(tree.record.model_copy(update={"state": "standby"}))
            server = RestoredServer(tree.identity.pid, host, 0, image.path, instance.id, instance.work,
                                    identity=tree.identity, state="standby",
                                    memory_bytes=tree_memory_bytes(tree.identity.pid))
        else:
            server = bring_up(tree, host, port, checked.target, timings)
    server.heartbeat = heartbeat
    server.lazy_pages = lazy
    server.timings = dict(timings.seconds)
    server.hashed_files = checked.hashed_files
    server.host_warnings = [f"{d.line} ({d.why})" for d in host_warnings]
    server.recovery.update(clock.seconds)
    return server


def _require_options(gpu: str | None, *, lazy_pages: bool, standby: bool) -> None:
    if standby and gpu is not None:
        raise UnsupportedOption("--gpu", f"--gpu {shown(gpu)}: a standby holds no GPU; give --gpu to `vsnap activate`")
    if standby and lazy_pages:
        raise UnsupportedOption("--lazy-pages", "a standby's memory is restored in full before it waits; "
                                                "restore it without --lazy-pages")


@dataclass
class _Checked:
    """What the verify phase found: the GPUs to restore onto, the host's differences that do not
    stop a restore, how many image files it hashed."""

    target: list[Gpu] | None
    warnings: list[HostDifference]
    hashed_files: int


def _verify(image: Image, host: str, port: int, gpu: str | None, clock: CheckClock, *, rehash: bool,
            lazy_pages: bool, standby: bool) -> _Checked:
    """The verify phase after the image is open: the control directory, the serving files, then
    the independent checks side by side (the GPU ones start the CUDA driver, which the CUDA restore
    needs anyway); the first failure in this order is the one reported."""
    manifest = image.manifest
    require_gpu_state(image, gpu)
    require_recorded_control_dir(manifest.control_dir)
    if not standby:  # a standby reads them when it is activated
        require_serving_files(manifest)
    clock.mark("trust_and_manifest")
    # (submitted before what waits for them: the pool starts its jobs in order, so nothing waits
    # for a job that has no thread)
    pool = ThreadPoolExecutor(max_workers=8)
    try:
        # the GPUs' facts once, for the host check and the GPU choice (two threads asking the
        # driver side by side slowed the 8B's verify phase from 0.17 s to 0.25 to 0.32 s)
        gpus = pool.submit(clock.call, "gpu_facts", gpu_early.gpu_facts) if manifest.cuda_processes else None
        hashing = pool.submit(clock.call, "files", image.verify_files, rehash=rehash)
        # the host's facts (CRIU's and the packages' versions, the GPUs) while the host check
        # compares the dependency files; it then waits for them
        facts = pool.submit(clock.call, "host_facts", current_facts, manifest, gpus)
        host_fit = pool.submit(clock.call, "host", image.require_fits_host, facts)
        checks = [pool.submit(check_privileges, "restore"),  # first: without them CRIU's own check fails vaguely
                  pool.submit(lambda: resources.require(resources.restore_needs(manifest), "restore")),
                  pool.submit(clock.call, "criu", check_criu_this_boot, VERIFIED_DIR), hashing, host_fit]
        if not standby:  # a standby binds no port and takes no GPU until it is activated
            checks.append(pool.submit(clock.call, "port", check_port_free, host, port))
        if lazy_pages:
            checks.append(pool.submit(check_lazy_pages, CriuRunner.locate()))
        choosing = (pool.submit(clock.call, "gpu", choose_gpus, manifest, gpu, gpus)
                    if manifest.cuda_processes and not standby else None)
        for check in checks:
            check.result()
        target = choosing.result() if choosing is not None else None
    except BaseException:
        # a refusal or an interrupt ends the phase now, not once every check has run: hashing the
        # image's files has no deadline (minutes for a large image); the checks not started never are
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown()
    return _Checked(target, host_fit.result(), len(hashing.result()))


@dataclass
class _Instance:
    """A new instance's host side, made by the prepare phase."""

    id: str
    work: Path  # its instance directory, bound at the tree's control path
    record: InstanceRecord
    shm_dir: Path  # bound at the tree's /dev/shm


def _prepare_host(image: Image, cleanup: Cleanup, *, standby: bool) -> _Instance:
    """The instance directory, its record, the captured engine log and /dev/shm files put back."""
    manifest = image.manifest
    read_ahead(image.weights_dir)  # read while CRIU and CUDA restore; the engine streams it at recover
    control.ensure_private_dir(make_trusted_dirs(Path(manifest.control_dir)))  # the mount point inside the tree
    instance_id, work = new_instance_dir(Path(manifest.control_dir), "r")
    record = InstanceRecord(id=instance_id, image=str(image.path), name=manifest.name, state="restoring",
                            owner=this_process(), instance_dir=str(work), started_at=time.time(),
                            image_digest=image.digest)
    register(record)  # `vsnap ps` and `vsnap stop` see it from now on
    cleanup.on_failure(unregister, instance_id)
    # CRIU reopens the log at its captured size and mode: put the captured log back.
    copy_no_follow(image.engine_log, work / control.ENGINE_LOG)
    if manifest.engine == "vllm":
        for name in TREE_DIRS:
            (work / name).mkdir(mode=0o700)
    if standby:  # before CRIU: the tree's first look at its control directory sees it
        control.write_message(work, control.STANDBY, Standby(since=time.time(), **control.stamp()))
    shm_dir = instance_shm_dir(instance_id)
    cleanup.on_failure(remove_instance_shm, shm_dir)
    put_back(image.shm_dir, manifest.shm_files, shm_dir)
    become_subreaper()
    return _Instance(instance_id, work, record, shm_dir)


def _criu_restore(image: Image, instance: _Instance, cleanup: Cleanup, *,
                  lazy_pages: bool) -> tuple[RestoredTree, LazyPagesServer | None]:
    """CRIU restores the tree into a fresh network namespace, its externals mapped to this
    instance's directories; the restored root must be a new child of ours and its namespace's PID 1."""
    manifest, work = image.manifest, instance.work
    externals = {**manifest.externals, manifest.control_mount_key: str(work),
                 manifest.shm_mount_key: str(instance.shm_dir)}
    netns = NetnsHolder()
    cleanup.on_exit(netns.close)
    runner = CriuRunner.locate()
    lazy = None
    if lazy_pages:
        lazy = runner.start_lazy_pages(LazyPagesOptions(
            images_dir=image.criu_dir, work_dir=work, log_file=work / LAZY_PAGES_LOG))
        cleanup.on_failure(lazy.kill)
    children_before = our_children()  # the restored root must be a new one
    cleanup.on_failure(_end_left_by_criu, instance, children_before)  # until the root is the cleanup's
    pid = runner.restore(RestoreOptions(
        images_dir=image.criu_dir, work_dir=work, log_file=work / RESTORE_LOG,
        pidfile=restore_pidfile(instance.id), externals=externals,
        inherit_fds={int(netns.fd or -1): manifest.netns_key}, lazy_pages=lazy_pages),
        on_started=lambda criu_pid: _record_criu(instance, criu_pid))
    identity = identify_restored_root(pid, children_before)  # a new child, its namespace's PID 1
    if identity is None:
        reap(pid)
        raise EngineError("criu restore", "EngineExited", f"the restored tree (pid {pid}) exited at once, or "
                          "is not a PID namespace's first process handed to vsnap", log_path=work / control.ENGINE_LOG)
    cleanup.on_failure(kill_tree, identity)
    record = instance.record.model_copy(update={"tree": ProcessRef.of(identity), "criu": None})
    register(record)
    netns.close()  # the restored tree keeps the namespace alive
    return RestoredTree(image, work, identity, record), lazy


def _end_left_by_criu(instance: _Instance, children_before: set[int]) -> None:
    """A restore that failed or was interrupted (SIGINT, `vsnap serve`'s SIGTERM) after CRIU started
    and before its tree was handed to the cleanup: end what CRIU left. First CRIU itself, with
    what it forked so far (an interrupt inside subprocess.Popen leaves it running, with no handle to
    it), then the tree it restored, which is ours once CRIU is gone (we are its subreaper). Only
    this restore's new children (host.instances.left_by_restore): a child of ours keeps its PID
    until we reap it, and another restore in this process is told apart by its instance directory."""
    failures: list[Exception] = []
    for _ in ("criu", "the tree it left"):
        for pid in sorted(our_children() - children_before):
            if left_by_restore(pid, instance.id, instance.work):
                try:
                    kill_tree(pid)
                except Exception as exc:  # one that outlived SIGKILL: still signal the others, then say so
                    failures.append(exc)
    if failures:
        raise failures[0]


def _record_criu(instance: _Instance, criu_pid: int) -> None:
    """Name the running `criu restore` in the instance's record before it restores anything: should
    this process die now, ps and stop still track what CRIU leaves (host.instances adopts its tree)."""
    identity = identify(criu_pid)
    if identity is not None:  # else it already exited: its failure is reported by the runner
        instance.record = instance.record.model_copy(update={"criu": ProcessRef.of(identity)})
        register(instance.record)
    failpoint(CRIU_RUNNING_FAILPOINT)


def wait_server(pid: int) -> None:
    """Block until the restored tree's root exits (a pidfd: no polling, no reused PID), then reap it."""
    wait_gone([pid], None)
    reap(pid)
