"""Running instances: each restore gets its own directory at the tree's control path, and a record.

The tree refers to its control directory (control files, engine log, vLLM's IPC sockets) by one
path, the spec's `snapshot.control_dir`. Inside the tree's mount namespace that path is a bind
mount of a host directory, declared external to CRIU: the capture binds one directory there, and
each restore binds a fresh one (`<control_dir>.instances/<id>`). So any number of restores of one
image run at once, each with its own files, PID namespace, GPU and port.

Records of instances live in RUNTIME_DIR/instances/<id>.json (`vsnap ps`, `vsnap stop`). A record
names processes by identity (PID, start time, boot), never by PID alone: a record whose process
ended, or whose PID now belongs to another process, is "gone": shown once as such, then pruned,
and never signalled. A restore registers its instance as "restoring" (owned by the restoring
vsnap process) before CRIU runs, so `vsnap stop` sees it; it turns "serving" once the oracle passed,
or "standby" once CRIU returned (`vsnap restore --standby`; "activating" while `vsnap activate` runs).

While CRIU restores, the record also names the CRIU process (``criu``). A restore whose vsnap
process dies then (SIGKILL, OOM) leaves CRIU running, and CRIU leaves a tree: the record stays
"running" while CRIU or that tree lives, and the first look at it (`vsnap ps`, `vsnap stop`, the
next restore's prune) adopts the tree into it (CRIU's child while CRIU runs, else the PID CRIU
wrote to its pidfile, checked), so `vsnap stop` ends it and `vsnap ps` shows it until it is gone.
CRIU's pidfiles (RUNTIME_DIR/pids/<id>.pid) that no live restore uses are removed by
prune_dead_runs.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import stat
import time
from pathlib import Path, PurePosixPath
from typing import Literal

from vsnap.protocol import control
from vsnap.protocol.records import Record, field

from .metrics import remove_instance_metrics
from .mounts import mount_roots
from .paths import RUNTIME_DIR, require_plain_path, require_runtime_dir
from .proctree import ProcessIdentity, identify, is_same, is_tree_root
from .shm import remove_instance_shm, remove_orphans, shm_dir_of
from .trust import make_trusted_dirs

PID_MAX = 1 << 22  # the kernel's pid_max can be at most 4194304
INSTANCE_NAME = re.compile(r"(?:capture|r|cold)-[0-9a-f]{8}")  # what new_instance_dir makes
URL = re.compile(r"https?://[^\s]{1,1016}")  # what a served instance is reached at (vsnap ps prints it)
GPUS = re.compile(r"GPU-[0-9a-f-]{36}(?:,GPU-[0-9a-f-]{36}){0,63}")  # a rank's GPU UUID each
RECORD_NAME = re.compile(rf"(?:{INSTANCE_NAME.pattern})\.json")  # an instance's or a capture's record
STOP_REQUEST = "stop.request"  # written into a restoring instance's directory by `vsnap stop`
ORPHAN_FORK_WAIT_S = 2.0  # how long a look at an orphaned CRIU waits for it to fork the tree's root


class ProcessRef(Record):
    """A recorded ProcessIdentity."""

    pid: int = field(ge=1, le=PID_MAX)
    start_time: int = field(ge=0, le=(1 << 63) - 1)
    boot_id: str

    @classmethod
    def of(cls, identity: ProcessIdentity) -> "ProcessRef":
        return cls(pid=identity.pid, start_time=identity.start_time, boot_id=identity.boot_id)

    @property
    def identity(self) -> ProcessIdentity:
        return ProcessIdentity(self.pid, self.start_time, self.boot_id)


def this_process() -> ProcessRef:
    identity = identify(os.getpid())
    assert identity is not None  # we are alive
    return ProcessRef.of(identity)


class InstanceRecord(Record):
    id: str
    image: str
    name: str
    # restoring -> serving; or restoring -> standby (CRIU restored, CUDA still checkpointed, no
    # port) -> activating -> serving
    state: Literal["restoring", "standby", "activating", "serving"]
    owner: ProcessRef                 # the vsnap process that restores (or restored) it
    tree: ProcessRef | None = None    # the restored tree's root, once CRIU returned
    criu: ProcessRef | None = None    # the `criu restore` process, from its start (a record of a restore)
    activator: ProcessRef | None = None  # the `vsnap activate` process, while activating
    image_digest: str = ""            # the image's manifest, as restored (an activation checks it)
    url: str = ""
    port: int = field(default=0, ge=0, le=65535)
    gpu: str | None = None
    instance_dir: str
    started_at: float = field(ge=0)
    # the phases of the command that brought it to serving (restore or activate), in seconds
    timings: dict[str, float] = field(default_factory=dict)
    # where its metrics file was written (VSNAP_METRICS_DIR of the command that wrote it): removed
    # from there when it is forgotten, whatever the remover's environment; "" when none was
    metrics_dir: str = ""

    def _check(self) -> None:
        """The id is one new_instance_dir made, and names the instance's directory: vsnap removes
        files and directories by it (a record is root's, but it is still input)."""
        if not INSTANCE_NAME.fullmatch(self.id):
            raise ValueError("id must be an instance name (r-XXXXXXXX)")
        require_plain_path(self.image, "image")
        require_plain_path(self.instance_dir, "instance_dir")
        if self.metrics_dir:
            require_plain_path(self.metrics_dir, "metrics_dir")
        work = PurePosixPath(self.instance_dir)
        if work.name != self.id or not work.parent.name.endswith(".instances"):
            raise ValueError("instance_dir must be CONTROL_DIR.instances/<id>")
        if self.url and not (URL.fullmatch(self.url) and self.url.isprintable()):
            raise ValueError("url must be an http:// or https:// address of at most 1024 printable characters")
        if self.gpu is not None and not GPUS.fullmatch(self.gpu):
            raise ValueError("gpu must be GPU UUIDs, comma-separated")

    @property
    def pid(self) -> int:
        """The tree's root PID (the owner's while there is no tree yet)."""
        return (self.tree or self.owner).pid

    @property
    def running(self) -> bool:
        """The processes this record names are still those processes."""
        if self.state == "restoring":
            return any(ref is not None and is_same(ref.identity) for ref in (self.owner, self.criu, self.tree))
        return self.tree is not None and is_same(self.tree.identity)


# A failed capture or restore keeps its directory (the logs its error names) this long.
KEEP_FAILED_S = 3 * 24 * 3600


def new_instance_dir(control_dir: Path, prefix: str) -> tuple[str, Path]:
    """A fresh private host directory to bind at ``control_dir`` inside one tree (old directories
    of failed runs beside it are removed on the way)."""
    instance_id = f"{prefix}-{secrets.token_hex(4)}"
    root = make_trusted_dirs(Path(f"{control_dir}.instances"))
    control.ensure_private_dir(root)
    prune_failed(root)
    return instance_id, control.ensure_private_dir(root / instance_id)


def prune_failed(root: Path, keep_s: float = KEEP_FAILED_S) -> list[str]:
    """Remove instance directories untouched for ``keep_s`` that no running instance uses: only
    what new_instance_dir made (its name, root's, private). The root is named by a manifest's
    control_dir, which may be hostile: whatever else sits in a directory of that name stays. A
    directory some process has bound (a live tree's control directory) stays too, whether or not a
    record names it (one another vsnap version wrote, or one under another VSNAP_RUNTIME_DIR)."""
    in_use = {Path(r.instance_dir).name for r in running_instances()}
    candidates = []
    for entry in root.iterdir():
        try:
            st = entry.lstat()
        except OSError:
            continue
        if entry.name not in in_use and time.time() - st.st_mtime >= keep_s and _made_here(entry.name, st):
            candidates.append(entry)
    if not candidates:
        return []
    mounted = {PurePosixPath(r).name for r in mount_roots()}  # instance names are random: a name is enough
    removed = []
    for entry in candidates:
        if entry.name not in mounted:
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry.name)
    return removed


def _made_here(name: str, st: os.stat_result) -> bool:
    """Could this entry of a `CONTROL_DIR.instances` directory be one new_instance_dir made: its
    name, a real directory, root's, private?"""
    return (INSTANCE_NAME.fullmatch(name) is not None and stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid()
            and not st.st_mode & 0o077)


def remove_instance_dir(instance_dir: Path) -> bool:
    """Remove a stopped instance's directory, only if it is one new_instance_dir made (in a
    `.instances` directory, _made_here): a record's instance_dir may name anything. Returns
    whether it was removed."""
    try:
        st = instance_dir.lstat()
    except FileNotFoundError:
        return False
    if not instance_dir.parent.name.endswith(".instances") or not _made_here(instance_dir.name, st):
        return False
    shutil.rmtree(instance_dir, ignore_errors=True)
    return True


def is_instance_tree(record: InstanceRecord) -> bool:
    """Is the record's ``tree`` (still) this instance's tree: the first process of a PID namespace of
    its own (is_tree_root) that sees the instance's directory mounted (its control directory: only
    this instance's tree binds it, instance names are random), or, while the record's CRIU still
    restores it and its mounts are not in place yet, that CRIU's child? A record's pids prove
    nothing alone."""
    tree = record.tree
    if tree is None or not is_tree_root(tree.identity):
        return False
    if _mounts_instance_dir(tree.pid, record.id):
        return True
    criu = record.criu
    return (criu is not None and is_same(criu.identity) and _parent(tree.pid) == criu.pid
            and _names_instance_dir(criu.pid, Path(record.instance_dir)))


def _parent(pid: int) -> int | None:
    import psutil

    try:
        return psutil.Process(pid).ppid()
    except psutil.Error:
        return None


def registry_dir() -> Path:
    require_runtime_dir()
    return control.ensure_private_dir(make_trusted_dirs(RUNTIME_DIR / "instances"))


def register(record: InstanceRecord) -> None:
    control.write_message(registry_dir(), f"{record.id}.json", record)


def unregister(instance_id: str) -> None:
    """Forget the instance: its record, and its metrics file, in the directory the record names
    (whatever this process's VSNAP_METRICS_DIR) and in this process's own metrics directory."""
    directory = registry_dir()
    try:
        record = control.read_message(directory, f"{instance_id}.json", InstanceRecord)
    except control.ControlProtocolError:
        record = None  # unreadable: still removed (as before), its metrics file only where this process has one
    try:
        os.unlink(directory / f"{instance_id}.json")
    except FileNotFoundError:
        pass
    if record is not None and record.id == instance_id and record.metrics_dir:
        remove_instance_metrics(instance_id, Path(record.metrics_dir))
    remove_instance_metrics(instance_id)


def pidfile_dir() -> Path:
    """CRIU's pidfiles: a directory of root's alone, never inside a tree's control directory (the
    restore makes it)."""
    return RUNTIME_DIR / "pids"


def pidfile_of(instance_id: str) -> Path:
    """Where CRIU writes the restored root's PID for this instance."""
    return pidfile_dir() / f"{instance_id}.pid"


def _criu_child_root(criu: ProcessRef) -> ProcessIdentity | None:
    """The tree's root while CRIU restores it: CRIU's child that is the first process of a PID
    namespace of its own and started after CRIU did (CRIU forked it)."""
    import psutil

    try:
        children = psutil.Process(criu.pid).children()
    except psutil.Error:
        return None
    for child in children:
        identity = identify(child.pid)
        if identity is not None and identity.start_time >= criu.start_time and is_tree_root(identity) \
                and is_same(criu.identity):  # still CRIU's: its children are the ones we listed
            return identity
    return None


def _mounts_instance_dir(pid: int, instance_id: str) -> bool:
    """Does ``pid`` see a mount whose root is this instance's directory (its control directory,
    which only this instance's tree binds: instance names are random)?"""
    try:
        with open(f"/proc/{pid}/mountinfo", "rb") as f:
            return any(len(fields) > 4 and PurePosixPath(os.fsdecode(fields[3])).name == instance_id
                       for fields in (line.split() for line in f))
    except OSError:
        return False


def left_by_restore(pid: int, instance_id: str, instance_dir: Path) -> bool:
    """Is ``pid`` (a child of the restoring process) what a restore of this instance started: its
    `criu restore` (the instance directory on its command line) or the tree CRIU restored (the
    first process of a PID namespace of its own that sees the instance's directory mounted)?"""
    if _names_instance_dir(pid, instance_dir):
        return True
    identity = identify(pid)
    return identity is not None and is_tree_root(identity) and _mounts_instance_dir(pid, instance_id)


def _names_instance_dir(pid: int, instance_dir: Path) -> bool:
    """Does ``pid``'s command line name ``instance_dir`` (as vsnap's `criu restore` does)?"""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return os.fsencode(instance_dir) in f.read().split(b"\0")
    except OSError:
        return False


def _pidfile_root(record: InstanceRecord, criu: ProcessRef) -> ProcessIdentity | None:
    """The tree's root after CRIU exited, from the pidfile CRIU wrote (in root's own directory, read
    without following links): that PID only if it is the first process of a PID namespace, started
    after that CRIU and seeing this instance's directory mounted (a PID reused since is none of these)."""
    try:
        fd = os.open(pidfile_of(record.id), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        text = os.read(fd, 32) if stat.S_ISREG(os.fstat(fd).st_mode) else b""
    finally:
        os.close(fd)
    try:
        pid = int(text.strip() or b"0")
    except ValueError:
        return None
    identity = identify(pid) if 0 < pid <= PID_MAX else None
    if identity is None or identity.start_time < criu.start_time or identity.boot_id != criu.boot_id:
        return None
    return identity if is_tree_root(identity) and _mounts_instance_dir(pid, record.id) else None


def _orphaned_root(record: InstanceRecord, criu: ProcessRef) -> ProcessIdentity | None:
    """The root of the tree an orphaned CRIU restores or restored. A CRIU that has not forked it yet
    is given ORPHAN_FORK_WAIT_S to (or to exit): a tree it forks later would belong to no record."""
    deadline = time.monotonic() + ORPHAN_FORK_WAIT_S
    while is_same(criu.identity):
        root = _criu_child_root(criu)
        if root is not None or time.monotonic() > deadline:
            return root
        time.sleep(0.02)
    return _pidfile_root(record, criu)


def adopt_orphaned_tree(record: InstanceRecord) -> InstanceRecord:
    """A restoring record whose vsnap process died while CRIU ran, with the tree CRIU restored
    named as its ``tree`` (and saved), so that stop ends it and ps shows it until it is gone; any
    other record as it is. Once adopted, CRIU's pidfile for it has served and is removed."""
    criu = record.criu
    if record.state != "restoring" or record.tree is not None or criu is None or is_same(record.owner.identity):
        return record
    root = _orphaned_root(record, criu)
    if root is None:
        return record
    adopted = record.model_copy(update={"tree": ProcessRef.of(root)})
    register(adopted)
    if not is_same(criu.identity):
        pidfile_of(record.id).unlink(missing_ok=True)
    return adopted


def remove_stale_pidfiles() -> list[str]:
    """Remove CRIU pidfiles of restores that no longer run: only files this vsnap names
    (``<instance id>.pid``, regular, root's) in its own pids directory, and only those whose
    instance has no record (a restore registers its record before CRIU starts and a record goes
    once nothing it names runs, so a restore in flight, even one that began after our listing,
    keeps its pidfile)."""
    try:
        entries = list(os.scandir(pidfile_dir()))
    except OSError:
        return []
    records = registry_dir()
    removed = []
    for entry in entries:
        name = entry.name
        if not name.endswith(".pid") or not INSTANCE_NAME.fullmatch(name[:-4]) \
                or os.path.lexists(records / f"{name[:-4]}.json"):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid():
            (pidfile_dir() / name).unlink(missing_ok=True)
            removed.append(name)
    return removed


def instance_records() -> tuple[list[InstanceRecord], list[InstanceRecord]]:
    """(running, gone): every record, checked against the processes it names. Gone records (ended,
    PID reused) are removed on the way; records that do not parse are skipped and kept."""
    directory = registry_dir()
    running, gone = [], []
    for path in sorted(directory.glob("*.json")):
        try:
            record = control.read_message(directory, path.name, InstanceRecord)
        except control.ControlProtocolError:
            # unreadable: not acted on, and not removed either (another vsnap version on this host
            # may have written it, for an instance it still runs and must still be able to stop)
            continue
        if record is None or path.name != f"{record.id}.json":  # a record under another's name: never acted on
            continue
        record = adopt_orphaned_tree(record)
        if record.running:
            running.append(record)
        else:
            gone.append(record)
            unregister(record.id)
            remove_instance_shm(shm_dir_of(record.id))  # its instance directory stays a while (logs)
    return running, gone


def running_instances() -> list[InstanceRecord]:
    """Records whose processes are still the recorded ones."""
    return instance_records()[0]


def stop_requested(instance_dir: Path) -> bool:
    return os.path.lexists(instance_dir / STOP_REQUEST)


def request_stop(record: InstanceRecord) -> None:
    """Ask the vsnap process that is restoring this instance to give up (it checks between phases)."""
    control.write_atomic(Path(record.instance_dir), STOP_REQUEST, b"stop\n")


def uptime(record: InstanceRecord) -> float:
    return time.time() - record.started_at


class CaptureRecord(Record):
    """A capture in progress: what to remove if its vsnap process dies without cleaning up (a
    staging directory full of process memory, the tree's /dev/shm directory)."""

    id: str
    owner: ProcessRef
    image: str
    staging: str
    shm_dir: str
    started_at: float = field(ge=0)

    def _check(self) -> None:
        """What prune_dead_runs removes by it: the capture's own staging directory beside its
        image and its own /dev/shm directory, nothing a record could point elsewhere."""
        if not INSTANCE_NAME.fullmatch(self.id):
            raise ValueError("id must be a capture name (capture-XXXXXXXX)")
        for value, what in ((self.image, "image"), (self.staging, "staging"), (self.shm_dir, "shm_dir")):
            require_plain_path(value, what)
        if self.shm_dir != str(shm_dir_of(self.id)):
            raise ValueError(f"shm_dir must be {shm_dir_of(self.id)}")


def captures_dir() -> Path:
    return control.ensure_private_dir(make_trusted_dirs(RUNTIME_DIR / "captures"))


def register_capture(record: CaptureRecord) -> None:
    control.write_message(captures_dir(), f"{record.id}.json", record)


def unregister_capture(capture_id: str) -> None:
    (captures_dir() / f"{capture_id}.json").unlink(missing_ok=True)


def _remove_staging(record: CaptureRecord) -> None:
    """A dead capture's staging directory, only if it is where and what a staging directory is."""
    staging, image = Path(record.staging), Path(record.image)
    if staging.parent != image.parent or not staging.name.startswith(f".{image.name}.staging-"):
        return
    try:
        st = staging.lstat()
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid():
        shutil.rmtree(staging, ignore_errors=True)


def prune_dead_runs() -> list[str]:
    """Remove what captures and restores whose vsnap process died left behind: staging
    directories, /dev/shm directories, records. Returns the ids cleaned up."""
    running, gone = instance_records()
    cleaned = [record.id for record in gone]
    known = {shm_dir_of(record.id).name for record in running}
    directory = captures_dir()
    for path in sorted(directory.glob("*.json")):
        try:
            record = control.read_message(directory, path.name, CaptureRecord)
        except control.ControlProtocolError:
            continue
        if record is None or path.name != f"{record.id}.json":
            continue
        if is_same(record.owner.identity):
            known.add(Path(record.shm_dir).name)
            continue
        _remove_staging(record)
        remove_instance_shm(Path(record.shm_dir))
        unregister_capture(record.id)
        cleaned.append(record.id)
    remove_stale_pidfiles()
    for records in (registry_dir(), directory):  # a record's temp file, left by a writer killed mid-write
        control.remove_stale_temp_files(records, RECORD_NAME)
    return cleaned + remove_orphans(known)
