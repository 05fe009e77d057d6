"""Standbys: `vsnap activate INSTANCE` serves a tree that `vsnap restore --standby` left waiting
after CRIU (its CUDA state still checkpointed, no GPU memory, no port)."""

from __future__ import annotations

import fcntl
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Iterator

from vsnap.host.cleanup import Cleanup
from vsnap.host.events import ProgressCallback, Timings
from vsnap.host.facts import check_root
from vsnap.host.http import check_port_free
from vsnap.host.instances import InstanceRecord, register, running_instances, this_process, unregister
from vsnap.host.paths import require_runtime_dir
from vsnap.host.proctree import ProcessIdentity, is_same, kill_tree
from vsnap.host.shm import remove_instance_shm, shm_dir_of
from vsnap.image.handle import open_image
from vsnap.image.store import held_lock
from vsnap.protocol import control
from vsnap.protocol.errors import ImageChanged, InstanceNotStandby, NothingRunning, ProcessTreeError, UnknownInstance

from .bringup import CheckClock, RestoredServer, RestoredTree, bring_up, check_stop, require_serving_files
from .gpus import choose_gpus, require_gpu_state
from .stop import require_tree_root

ACTIVATION_LOCK = "activation.lock"  # in a standby's instance directory, held by `vsnap activate`


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
    weights from its image, the oracle, then host:port. Its owner stays whoever restored it while
    that vsnap lives (a foreground `vsnap restore --standby` still ends it on Ctrl-C; a detached
    one runs on); an owner gone by the time it serves leaves it detached (owner_takeover).

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
            require_tree_root(record, "activate")
            identity = record.tree.identity
            work, image_dir = Path(record.instance_dir), Path(record.image)
            held.enter_context(activation_lock(work, instance_id))
            record = standby_record(instance_id)  # again, under the lock: another activation may have won
            owner_beat = owner_takeover(work, identity, cleanup)
            image = reading.enter_context(open_image(image_dir))  # the weights are read again
            manifest = image.manifest
            if not image.is_capture_of(record.image_digest):
                raise ImageChanged(image_dir, instance_id)
            require_gpu_state(image, gpu)
            require_serving_files(manifest)
            clock.mark("trust_and_manifest")
            with ThreadPoolExecutor(max_workers=3) as pool:
                checks = [pool.submit(clock.call, "files", image.verify_files),
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
            heartbeat = activator_heartbeat(work, identity, cleanup)
        check_stop(work)
        server = bring_up(RestoredTree(image, work, identity, activating), host, port, target, timings)
        heartbeat.detach()  # it serves, and is recorded so: the tree is its owner's again
        if owner_beat is not None:
            hand_back(owner_beat, record)
    server.timings = dict(timings.seconds)
    server.recovery.update(clock.seconds)
    return server


def activator_heartbeat(work: Path, identity: ProcessIdentity, cleanup: Cleanup) -> control.OwnerHeartbeat:
    """activator.json, beaten from before the CUDA restore until the tree serves: a tree whose
    activator dies (SIGKILL, OOM, a node agent's pod ended) ends itself within
    ACTIVATOR_TIMEOUT_S instead of holding its restored GPU state, and the existing prune paths
    then drop its record and /dev/shm directory. Not the owner's heartbeat: a detached standby
    has none, and a foreground owner outliving its activator must not keep a half-activated tree."""
    heartbeat = control.OwnerHeartbeat(work, while_alive=lambda: is_same(identity), name=control.ACTIVATOR)
    heartbeat.start()
    cleanup.on_failure(heartbeat.stop)  # newest first: it stops before the tree is ended
    return heartbeat


def owner_takeover(work: Path, identity: ProcessIdentity, cleanup: Cleanup) -> control.OwnerHeartbeat | None:
    """Beat owner.json beside the standby's owner from the start of the activation, unless the
    standby was handed over (detached): a foreground standby whose owner died (SIGKILL, a closed
    terminal) ends itself once owner.json has been silent for OWNER_TIMEOUT_S, and it used to do so
    seconds after its activation had reported that it serves (hostile pass 14). hand_back decides
    who owns it once it serves; on failure the beat stops, and a tree whose owner is gone ends."""
    owner = control.read_message(work, control.OWNER, control.Owner)
    if owner is not None and owner.detached:
        return None
    heartbeat = control.OwnerHeartbeat(work, while_alive=lambda: is_same(identity)).start()
    cleanup.on_failure(heartbeat.stop)
    return heartbeat


def hand_back(owner_beat: control.OwnerHeartbeat, record: InstanceRecord) -> None:
    """The tree serves: back to the vsnap that restored it while that one lives (it beats
    owner.json too, and its Ctrl-C or death still ends the tree), detached when it is gone: an
    activated instance keeps serving, as one activated from a detached standby does."""
    if is_same(record.owner.identity):
        owner_beat.stop()
    else:
        owner_beat.detach()


@contextmanager
def activation_lock(work: Path, instance_id: str) -> Iterator[None]:
    """One activation of a standby at a time: a second would restore its CUDA state again, fail,
    and end the tree the first is bringing up. An flock on a file in the instance's own private
    directory (made by vsnap, opened without following links), held until the activation returns."""
    control.check_private_dir(work)
    with held_lock(work / ACTIVATION_LOCK, fcntl.LOCK_EX, 0,
                   lambda: InstanceNotStandby(instance_id, "being activated by another vsnap")):
        yield
