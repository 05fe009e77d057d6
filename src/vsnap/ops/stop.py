"""`vsnap stop`: end an instance vsnap restored, or ask one still being restored to give up."""

from __future__ import annotations

import time
from pathlib import Path

from vsnap.host.instances import (
    InstanceRecord,
    is_instance_tree,
    remove_instance_dir,
    request_stop,
    running_instances,
    unregister,
)
from vsnap.host.proctree import is_same, is_vsnap_command, kill_tree, reap
from vsnap.host.shm import remove_instance_shm, shm_dir_of
from vsnap.protocol.errors import ProcessTreeError

from .bringup import RestoredServer

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
        require_tree_root(server, "stop")
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
    remove_instance_dir(Path(work))  # only one vsnap made: a record may name any directory
    remove_instance_shm(shm_dir_of(instance_id))


def require_tree_root(record: InstanceRecord, phase: str) -> None:
    """A record's tree is acted on (signalled, activated) only while it is that instance's tree
    (host.instances.is_instance_tree: the first process of a PID namespace of its own, seeing the
    instance's directory mounted): a record naming another live process (crafted, or left by a bug)
    is refused, not acted on. A tree that is gone is the caller's case."""
    if record.tree is not None and is_same(record.tree.identity) and not is_instance_tree(record):
        raise ProcessTreeError(record.tree.pid, f"the record of {record.id} names pid {record.tree.pid}, which is not "
                               "the first process of a PID namespace of its own with that instance's directory "
                               "mounted: not its vsnap tree, not signalled", phase=phase)


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
    if is_same(stuck) and is_vsnap_command(stuck.pid):  # a stuck restore: end it, then the tree
        kill_tree(stuck, grace_s=5)  # (never another program a record names, nor one that took its PID)
    if record.tree is not None and is_instance_tree(record):
        kill_tree(record.tree.identity)
    unregister(record.id)
    remove_instance_shm(shm_dir_of(record.id))
