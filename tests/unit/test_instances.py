"""Old directories of failed runs are pruned; running instances' and recent ones are kept."""

import os
import time
from pathlib import Path

import pytest

from vsnap.host import instances as _instances
from vsnap.host.instances import InstanceRecord, new_instance_dir, register, this_process


def test_failed_runs_are_pruned_after_a_while(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_instances, "RUNTIME_DIR", tmp_path / "run")
    control_dir = tmp_path / "control"
    root = Path(f"{control_dir}.instances")
    old_failed, old_running, recent = (root / name for name in ("r-0000000a", "r-0000000b", "r-0000000c"))
    root.mkdir(mode=0o700)
    for directory in (old_failed, old_running, recent):
        directory.mkdir(mode=0o700)
        (directory / "engine.log").write_text("log")
    long_ago = time.time() - _instances.KEEP_FAILED_S - 60
    for directory in (old_failed, old_running):
        os.utime(directory, (long_ago, long_ago))
    register(InstanceRecord(id="r-0000000b", image="/i", name="n", state="restoring", owner=this_process(),
                            instance_dir=str(old_running), started_at=long_ago))
    instance_id, fresh = new_instance_dir(control_dir, "r")
    assert sorted(p.name for p in root.iterdir()) == sorted(["r-0000000b", "r-0000000c", instance_id])
    assert fresh.is_dir()


def test_only_what_vsnap_made_is_pruned(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Hostile pass 9: a manifest's control_dir (a pulled image's, say) names the instances root;
    any old directory in an existing `<control_dir>.instances` was removed, whatever its name or owner."""
    monkeypatch.setattr(_instances, "RUNTIME_DIR", tmp_path / "run")
    control_dir = tmp_path / "data"
    root = Path(f"{control_dir}.instances")
    root.mkdir(mode=0o700)
    long_ago = time.time() - _instances.KEEP_FAILED_S - 60
    names = ("backups", "r-0000000a", "capture-0000000b", "cold-0000000c", "r-0000000d", "r-0000000e")
    for name in names:
        (root / name).mkdir(mode=0o700)
        (root / name / "precious").write_text("x")
    os.chown(root / "r-0000000d", 65534, 65534)  # not root's
    os.chmod(root / "r-0000000e", 0o755)  # not private
    for name in names:
        os.utime(root / name, (long_ago, long_ago))
    instance_id, _ = new_instance_dir(control_dir, "r")
    assert sorted(p.name for p in root.iterdir()) == sorted(["backups", "r-0000000d", "r-0000000e", instance_id])


def test_a_record_whose_pid_was_reused_is_gone_and_never_signalled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The record names a process by PID and start time: the same PID with another start time is another process."""
    import subprocess

    from vsnap.host.instances import ProcessRef, instance_records, running_instances
    from vsnap.ops.stop import stop_server

    monkeypatch.setattr(_instances, "RUNTIME_DIR", tmp_path / "run")
    bystander = subprocess.Popen(["sleep", "60"])  # an unrelated process that now holds the recorded PID
    try:
        me = this_process()
        real = ProcessRef(pid=bystander.pid, start_time=_instances.identify(bystander.pid).start_time, boot_id=me.boot_id)
        reused = real.model_copy(update={"start_time": real.start_time - 1})  # the instance's tree started earlier
        directory = tmp_path / "ctl.instances" / "r-0000dead"
        directory.mkdir(parents=True)
        record = InstanceRecord(id="r-0000dead", image="/i", name="n", state="serving", owner=me, tree=reused,
                                url="http://x", port=1, instance_dir=str(directory), started_at=time.time())
        register(record)
        assert not record.running
        stop_server(record)  # must not touch the bystander
        assert bystander.poll() is None
        register(record)
        running, gone = instance_records()
        assert running == [] and [r.id for r in gone] == ["r-0000dead"]
        assert running_instances() == []  # pruned
        assert list((tmp_path / "run" / "instances").iterdir()) == []
        live = record.model_copy(update={"tree": real})
        assert live.running  # the check can tell the difference
    finally:
        bystander.kill()
        bystander.wait()


def test_orphaned_shm_directories_go_and_nothing_else(tmp_path: Path) -> None:
    """/dev/shm/vsnap-* directories no record names and no tree mounts are removed; what vsnap
    did not make (another owner's mode, a link) and what is young stays."""
    import secrets

    from vsnap.host.shm import SHM, remove_orphans

    tag = secrets.token_hex(4)
    old, young, shared, link = (SHM / f"vsnap-test-{tag}-{n}" for n in ("old", "young", "shared", "link"))
    try:
        for directory in (old, young, shared):
            directory.mkdir(mode=0o700)
        os.chmod(shared, 0o755)
        link.symlink_to(tmp_path)
        long_ago = time.time() - 3600
        for path in (old, shared):
            os.utime(path, (long_ago, long_ago))
        os.utime(link, (long_ago, long_ago), follow_symlinks=False)
        removed = remove_orphans(known={young.name})
        assert old.name in removed and not {young.name, shared.name, link.name} & set(removed)
        assert not old.exists() and young.is_dir() and shared.is_dir() and link.is_symlink() and tmp_path.is_dir()
    finally:
        for path in (young, shared):
            if path.is_dir():
                path.rmdir()
        link.unlink(missing_ok=True)


def test_every_regular_file_of_a_trees_shm_is_saved_and_nothing_else(tmp_path: Path) -> None:
    from vsnap.host.shm import tree_shm_files
    from vsnap.protocol.errors import ProcessTreeError

    shm = tmp_path / "shm"
    shm.mkdir()
    for name in ("link_remap.3", "psm_1a2b", "sem.mp-x"):
        (shm / name).write_bytes(b"x")
    assert tree_shm_files(shm) == ["link_remap.3", "psm_1a2b", "sem.mp-x"]
    (shm / "sub").mkdir()
    with pytest.raises(ProcessTreeError, match="sub in its /dev/shm, which is not a regular file"):
        tree_shm_files(shm)


def test_standby_records_follow_their_tree_and_unreadable_records_are_kept(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A standby (or an activating one) runs while its tree runs, whoever owns it; a record another
    vsnap version wrote (it does not parse here) is neither acted on nor removed."""
    from vsnap.host.instances import instance_records

    monkeypatch.setattr(_instances, "RUNTIME_DIR", tmp_path / "run")
    me = this_process()
    dead = me.model_copy(update={"start_time": me.start_time - 1})
    for state in ("standby", "activating", "serving"):
        record = InstanceRecord(id="r-00000001", image="/i", name="n", state=state, owner=dead, tree=me,
                                instance_dir=str(tmp_path / "c.instances" / "r-00000001"), started_at=time.time())
        assert record.running, state  # its owner is gone (a detached standby), its tree is not
        assert not record.model_copy(update={"tree": dead}).running, state
    restoring = InstanceRecord(id="r-00000002", image="/i", name="n", state="restoring", owner=me,
                               instance_dir=str(tmp_path / "c.instances" / "r-00000002"), started_at=time.time())
    assert restoring.running  # no tree yet: its restoring owner is what runs
    register(restoring)
    foreign = _instances.registry_dir() / "r-3.json"
    foreign.write_text('{"id": "r-3", "state": "hibernating", "from": "a later vsnap"}')
    os.chmod(foreign, 0o600)
    running, gone = instance_records()
    assert [r.id for r in running] == ["r-00000002"] and gone == []
    assert foreign.exists()


class NamespaceTree:
    """A `sleep` that is PID 1 of a PID namespace of its own, as a vsnap tree's root is (needs root);
    with ``bind``, it sees that directory bound in a mount namespace of its own, as a tree sees its
    instance directory at its control directory."""

    def __init__(self, bind: Path | None = None, naming: Path | None = None) -> None:
        import shutil
        import subprocess

        if os.geteuid() != 0 or shutil.which("unshare") is None:
            pytest.skip("makes a PID namespace: needs root and unshare")
        # ``naming``: a path on unshare's command line, as vsnap's `criu restore` names the instance directory
        command = ["sleep", "60"] if bind is None and naming is None else [
            "sh", "-c", ('mount --bind "$0" "$0" && ' if bind else "") + "exec sleep 60", str(bind or naming)]
        self.unshare = subprocess.Popen(["unshare", "--pid", "--fork", *(["--mount"] if bind else []), *command])
        deadline = time.monotonic() + 10
        while True:
            children = Path(f"/proc/{self.unshare.pid}/task/{self.unshare.pid}/children").read_text().split()
            if children and _instances.identify(int(children[0])) is not None:
                self.pid = int(children[0])
                break
            assert time.monotonic() < deadline, "unshare did not start its child"
            time.sleep(0.01)
        while bind is not None and not _instances._mounts_instance_dir(self.pid, bind.name):  # sh mounts, then sleeps
            assert time.monotonic() < deadline, "the tree did not mount its directory"
            time.sleep(0.01)
        self.ref = _instances.ProcessRef.of(_instances.identify(self.pid))

    def close(self) -> None:
        self.unshare.kill()
        self.unshare.wait()


def test_stopping_an_activation_whose_vsnap_died_does_not_wait(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Hostile pass 9: a `vsnap activate` killed with SIGKILL left its standby "activating"; `vsnap stop`
    then waited the whole STOP_WAIT_S (60 s) for an answer no process would give."""
    import subprocess

    from vsnap.host.instances import ProcessRef, running_instances
    from vsnap.host.proctree import is_same
    from vsnap.ops.stop import stop_server

    monkeypatch.setattr(_instances, "RUNTIME_DIR", tmp_path / "run")
    me = this_process()
    dead = subprocess.Popen(["sleep", "60"])  # the activator, then SIGKILLed
    dead_ref = ProcessRef(pid=dead.pid, start_time=_instances.identify(dead.pid).start_time, boot_id=me.boot_id)
    dead.kill()
    dead.wait()
    directory = tmp_path / "ctl.instances" / "r-0000000f"
    directory.mkdir(parents=True, mode=0o700)
    os.chmod(directory.parent, 0o700)
    tree = NamespaceTree(bind=directory)  # the half-activated standby's tree
    try:
        register(InstanceRecord(id="r-0000000f", image="/i", name="n", state="activating", owner=me, tree=tree.ref,
                                activator=dead_ref, instance_dir=str(directory), started_at=time.time()))
        started = time.monotonic()
        stop_server(running_instances()[0])
        assert time.monotonic() - started < 10
        deadline = time.monotonic() + 10
        while is_same(tree.ref.identity) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not is_same(tree.ref.identity) and running_instances() == []
    finally:
        tree.close()


def test_a_record_naming_a_process_that_is_no_tree_is_never_signalled(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Hostile pass 11: a record (root's, but input) naming the identity of an unrelated process got it
    killed by `vsnap stop`, and its instance_dir removed; one naming an unrelated owner got that
    killed after STOP_WAIT_S."""
    import subprocess

    from vsnap.host.instances import ProcessRef, running_instances
    from vsnap.ops.stop import stop_server
    from vsnap.protocol.errors import ProcessTreeError

    monkeypatch.setattr(_instances, "RUNTIME_DIR", tmp_path / "run")
    bystander = subprocess.Popen(["sleep", "60"])
    try:
        ref = ProcessRef.of(_instances.identify(bystander.pid))
        directory = tmp_path / "ctl.instances" / "r-0000b0b0"
        directory.mkdir(parents=True, mode=0o700)
        (directory / "keep").write_text("x")
        register(InstanceRecord(id="r-0000b0b0", image="/i", name="n", state="serving", owner=this_process(), tree=ref,
                                instance_dir=str(directory), started_at=time.time()))
        [record] = running_instances()
        with pytest.raises(ProcessTreeError, match="not the first process of a PID namespace"):
            stop_server(record)
        assert bystander.poll() is None and (directory / "keep").exists()
        # a restoring record whose "owner" is not vsnap: after the wait, the owner is not signalled
        monkeypatch.setattr("vsnap.ops.stop.STOP_WAIT_S", 0.2)
        stuck = record.model_copy(update={"state": "restoring", "tree": None, "owner": ref})
        register(stuck)
        stop_server(stuck)
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()


def test_a_record_under_another_name_or_with_a_crafted_id_is_not_acted_on(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Hostile pass 11: a dead record whose id was a path ("../../../tmp/victim") or another live
    instance's id made `vsnap ps` delete that file (or the live record) and the live tree's /dev/shm."""
    import json

    from vsnap.host.instances import instance_records, registry_dir
    from vsnap.protocol.records import RecordError

    monkeypatch.setattr(_instances, "RUNTIME_DIR", tmp_path / "run")
    victim = tmp_path / "victim.json"
    victim.write_text("{}")
    dead = this_process().model_copy(update={"start_time": this_process().start_time - 1}).model_dump()
    for name, record_id in (("trav.json", "../../../" + str(victim)[1:-5]), ("a-shadow.json", "r-0000abcd")):
        path = registry_dir() / name
        path.write_text(json.dumps({"id": record_id, "image": "/i", "name": "n", "state": "restoring", "owner": dead,
                                    "instance_dir": f"/c.instances/{record_id}", "started_at": 1.0}))
        os.chmod(path, 0o600)
    live = registry_dir() / "r-0000abcd.json"
    register(InstanceRecord(id="r-0000abcd", image="/i", name="n", state="restoring", owner=this_process(),
                            instance_dir="/c.instances/r-0000abcd", started_at=time.time()))
    running, gone = instance_records()
    assert [r.id for r in running] == ["r-0000abcd"] and gone == []
    assert victim.exists() and live.exists() and (registry_dir() / "a-shadow.json").exists()
    with pytest.raises(RecordError, match="id must be an instance name"):
        InstanceRecord(id="../x", image="/i", name="n", state="serving", owner=this_process(),
                       instance_dir="/c.instances/../x", started_at=1.0)
    with pytest.raises(RecordError, match="absolute path"):
        InstanceRecord(id="r-00000001", image="/i\0", name="n", state="serving", owner=this_process(),
                       instance_dir="/c.instances/r-00000001", started_at=1.0)


def test_a_directory_a_live_tree_has_bound_is_never_pruned(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Hostile pass 10: a live instance whose record this vsnap cannot read (another version's) or
    that another VSNAP_RUNTIME_DIR records was pruned after three days, its control directory
    (owner.json, status.json, listen.sock) removed under the serving tree."""
    import shutil
    import subprocess

    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("binds a directory in a mount namespace of its own: needs root and unshare")
    monkeypatch.setattr(_instances, "RUNTIME_DIR", tmp_path / "run")  # no record names it
    control_dir = tmp_path / "control"
    control_dir.mkdir()
    root = Path(f"{control_dir}.instances")
    root.mkdir(mode=0o700)
    live, dead = root / "r-0000001a", root / "r-0000001b"
    for directory in (live, dead):
        directory.mkdir(mode=0o700)
        (directory / "owner.json").write_text("{}")
        long_ago = time.time() - _instances.KEEP_FAILED_S - 60
        os.utime(directory, (long_ago, long_ago))
    tree = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                             f'mount --bind "{live}" "{control_dir}" && echo bound && exec sleep 60'],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert tree.stdout is not None and tree.stdout.readline().strip() == "bound"
        instance_id, _ = new_instance_dir(control_dir, "r")
        assert sorted(p.name for p in root.iterdir()) == sorted(["r-0000001a", instance_id])
        assert (live / "owner.json").exists()
    finally:
        tree.kill()
        tree.wait()


def test_a_mount_path_that_is_not_utf8_does_not_stop_the_pruning() -> None:
    """Review of hostile pass 10: any user may bind a directory named b"\\xff" in a namespace of
    their own; reading mountinfo as UTF-8 text then raised UnicodeDecodeError in every restore."""
    import shutil
    import subprocess
    import tempfile

    from vsnap.host.mounts import mount_roots

    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("mounts in a namespace of its own: needs root and unshare")
    with tempfile.TemporaryDirectory() as scratch:
        odd = os.path.join(os.fsencode(scratch), b"\xff")
        os.mkdir(odd)
        tree = subprocess.Popen([b"unshare", b"--mount", b"--propagation", b"private", b"sh", b"-c",
                                 b'mount --bind "$0" "$0" && echo bound && exec sleep 60', odd],
                                stdout=subprocess.PIPE, text=True)
        try:
            assert tree.stdout is not None and tree.stdout.readline().strip() == "bound"
            name = os.fsdecode(os.path.basename(odd))  # the root is relative to its filesystem's root
            assert any(root.endswith(os.fsdecode(os.path.basename(os.fsencode(scratch))) + "/" + name)
                       for root in mount_roots())
        finally:
            tree.kill()
            tree.wait()


def test_a_bind_in_another_user_namespace_does_not_pin_a_directory(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Hostile pass 11: any user can bind a directory of vsnap's name in a user and mount namespace
    of their own (unshare -Urm); that kept failed runs' directories for ever (and every restore
    scanned each such process). vsnap's trees never leave vsnap's user namespace."""
    import shutil
    import subprocess

    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare")
    monkeypatch.setattr(_instances, "RUNTIME_DIR", tmp_path / "run")
    control_dir = tmp_path / "control"
    control_dir.mkdir()
    root = Path(f"{control_dir}.instances")
    root.mkdir(mode=0o700)
    old = root / "r-0000002a"
    old.mkdir(mode=0o700)
    long_ago = time.time() - _instances.KEEP_FAILED_S - 60
    os.utime(old, (long_ago, long_ago))
    other = subprocess.Popen(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
                              f'mount --bind "{old}" "{control_dir}" && echo bound && exec sleep 60'],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = other.stdout.readline().strip() if other.stdout is not None else ""
        if line != "bound":
            pytest.skip(f"this kernel lets no user namespace bind here: {other.stderr.read()[-200:] if other.stderr else ''}")
        instance_id, _ = new_instance_dir(control_dir, "r")
        assert sorted(p.name for p in root.iterdir()) == [instance_id]
    finally:
        other.kill()
        other.wait()


def test_a_restore_killed_while_criu_runs_is_tracked_and_stopped(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Hostile pass 12: a restore SIGKILLed in CRIU left a tree running for 15-20 s that `vsnap ps` called
    gone and `vsnap stop` could not find. The record names CRIU (here an `unshare` whose child is
    the namespace's PID 1, as CRIU's is) and the tree is adopted from it."""
    import subprocess

    from vsnap.host.instances import ProcessRef, instance_records, running_instances
    from vsnap.host.proctree import is_same
    from vsnap.ops.stop import stop_server

    monkeypatch.setattr(_instances, "RUNTIME_DIR", tmp_path / "run")
    dead = subprocess.Popen(["sleep", "60"])  # the restoring vsnap, then SIGKILLed
    owner = ProcessRef.of(_instances.identify(dead.pid))
    dead.kill()
    dead.wait()
    directory = tmp_path / "ctl.instances" / "r-0000001a"
    directory.mkdir(parents=True, mode=0o700)
    os.chmod(directory.parent, 0o700)
    criu = NamespaceTree(naming=directory)  # the tree's mounts not in place yet: proven as that CRIU's child
    try:
        register(InstanceRecord(id="r-0000001a", image="/i", name="n", state="restoring", owner=owner,
                                criu=ProcessRef.of(_instances.identify(criu.unshare.pid)),
                                instance_dir=str(directory), started_at=time.time()))
        running, gone = instance_records()
        assert gone == [] and [r.id for r in running] == ["r-0000001a"]
        assert running[0].tree == criu.ref  # adopted, and saved
        assert running_instances()[0].tree == criu.ref
        stop_server(running[0])
        deadline = time.monotonic() + 10
        while is_same(criu.ref.identity) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not is_same(criu.ref.identity)
        assert running_instances() == []
    finally:
        criu.close()


def test_only_stale_criu_pidfiles_of_vsnap_are_removed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A restore killed in CRIU left RUNTIME_DIR/pids/<id>.pid for ever; the prune removes such a file
    once its instance has no record, and nothing else in that directory."""
    from vsnap.host.instances import pidfile_dir, prune_dead_runs

    monkeypatch.setattr(_instances, "RUNTIME_DIR", tmp_path / "run")
    pids = pidfile_dir()
    pids.mkdir(parents=True, mode=0o700)
    directory = tmp_path / "ctl.instances" / "r-0000000b"
    directory.mkdir(parents=True, mode=0o700)
    register(InstanceRecord(id="r-0000000b", image="/i", name="n", state="restoring", owner=this_process(),
                            instance_dir=str(directory), started_at=time.time()))
    for name in ("r-0000000a.pid", "r-0000000b.pid", "notes.pid", "r-0000000d.pid", "r-0000000e.txt"):
        (pids / name).write_text("123\n")
    os.chown(pids / "r-0000000d.pid", 65534, 65534)
    (pids / "r-0000000c.pid").symlink_to(tmp_path / "elsewhere")
    prune_dead_runs()
    assert sorted(p.name for p in pids.iterdir()) == ["notes.pid", "r-0000000b.pid", "r-0000000c.pid",
                                                       "r-0000000d.pid", "r-0000000e.txt"]


def test_a_tree_is_acted_on_only_with_its_instance_directory_mounted(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Hostile pass 18: a record naming the first process of any PID namespace (a container's init,
    an `unshare -p`) got it killed by `vsnap stop`, and the directory the record named (another
    user's) removed. A tree is vsnap's instance only if it sees that instance's directory mounted;
    a directory is removed only if it is one vsnap made."""
    import subprocess

    from vsnap.host.instances import is_instance_tree, remove_instance_dir, running_instances
    from vsnap.ops.stop import stop_server
    from vsnap.protocol.errors import ProcessTreeError

    monkeypatch.setattr(_instances, "RUNTIME_DIR", tmp_path / "run")
    theirs = tmp_path / "victim.instances" / "r-deadbeef"
    theirs.mkdir(parents=True)
    (theirs / "precious.txt").write_text("alice's")
    os.chown(theirs, 65534, 65534)
    foreign = NamespaceTree()  # a namespace root that is no vsnap tree
    try:
        register(InstanceRecord(id="r-deadbeef", image="/i", name="n", state="serving", owner=this_process(),
                                tree=foreign.ref, instance_dir=str(theirs), started_at=time.time()))
        [record] = running_instances()
        assert not is_instance_tree(record)
        with pytest.raises(ProcessTreeError, match="with that instance's directory mounted"):
            stop_server(record)
        assert foreign.unshare.poll() is None and (theirs / "precious.txt").exists()
    finally:
        foreign.close()
    assert not remove_instance_dir(theirs) and theirs.exists()  # another user's: never removed
    loose = tmp_path / "r-0000feed"  # vsnap's name, root's, private, but in no .instances directory
    loose.mkdir(mode=0o700)
    assert not remove_instance_dir(loose) and loose.exists()
    ours = tmp_path / "ctl.instances" / "r-0000f00d"
    ours.mkdir(parents=True, mode=0o700)
    tree = NamespaceTree(bind=ours)
    try:
        mine = InstanceRecord(id="r-0000f00d", image="/i", name="n", state="serving", owner=this_process(),
                              tree=tree.ref, instance_dir=str(ours), started_at=time.time())
        assert is_instance_tree(mine)
        assert not is_instance_tree(mine.model_copy(update={"id": "r-0000f00e",
                                                            "instance_dir": str(ours.with_name("r-0000f00e"))}))
    finally:
        tree.close()
    assert remove_instance_dir(ours) and not ours.exists()


def test_an_owner_is_the_vsnap_command_only_if_it_runs_vsnaps_console_script(tmp_path: Path) -> None:
    """Hostile pass 18: a record's stuck owner was ended if argv[0] or argv[1] was any file named
    vsnap (`python3 notes/vsnap`, `less /var/log/vsnap`). The script must import vsnap.cli, as the
    console script pip writes does (a text search of its first 4 KiB); a device or FIFO named vsnap
    is never opened."""
    import subprocess

    from vsnap.host.proctree import is_vsnap_command

    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "vsnap").write_text("import time\ntime.sleep(60)\n")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "vsnap").write_text("import time\n# from vsnap.cli import main, as pip writes it\ntime.sleep(60)\n")
    (tmp_path / "fifo").mkdir()
    os.mkfifo(tmp_path / "fifo" / "vsnap")
    started = [subprocess.Popen(["python3", "notes/vsnap"], cwd=tmp_path),
               subprocess.Popen(["python3", str(tmp_path / "bin" / "vsnap")]),
               subprocess.Popen(["python3", "-c", "import time; time.sleep(60)", "-m", "vsnap"]),
               subprocess.Popen([str(tmp_path / "fifo" / "vsnap"), "60"], executable="sleep")]  # argv[0] a FIFO
    try:
        time.sleep(0.3)
        assert all(p.poll() is None for p in started)  # alive while asked
        assert [is_vsnap_command(p.pid) for p in started] == [False, True, False, False]
    finally:
        for p in started:
            p.kill()
            p.wait()
