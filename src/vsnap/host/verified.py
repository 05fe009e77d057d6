"""Which image files this host has already hashed, so a restore does not hash them again.

A restore must know every image file is the one the manifest names before CRIU runs. Hashing
takes about 0.1 s per GB on 16 cores; an 8B image with its weights file is ~20 GB. So a file is
hashed in full once (at capture, by the first restore, or by ``vsnap validate``), and its identity
is remembered as (device, inode, size, mtime, ctime): any write or chmod changes ctime, which
no one but the kernel sets (short of changing the system clock, which needs root). Only a file
whose ctime was already older than its stat by a margin is remembered (git's "racily clean"
problem): the kernel stamps files from a coarse clock (one tick, up to 10 ms; on some filesystems
a whole second), so a write in the same tick as the change before the stat would leave ctime as it
was; such a file is hashed again next time, by when it is no longer recent. A file is
only remembered when it is owned by this user and not writable by group or others, inside the
image directory whose parent ``check_parent`` already requires to be private. The record lives
under /run (tmpfs): a reboot forgets it, and the next restore hashes everything again. The records
are protocol.records, read strictly (read_cache, also registry/pushed's): one that is not exactly
its record, or that anyone but root could have written, is no record, never an error.
"""

from __future__ import annotations

import hashlib
import os
import stat
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Literal, TypeVar

from vsnap.protocol import control
from vsnap.protocol.errors import ControlProtocolError
from vsnap.protocol.records import Record, RecordError, is_plain

from .paths import RUNTIME_DIR

VERIFIED_DIR = RUNTIME_DIR / "verified"

Identity = list[int]
R = TypeVar("R", bound=Record)


class Hashed(Record):
    """A file hashed before: its identity when it was stat'ed (identity()) and the sha256 it had."""

    identity: list[int]
    sha256: str


class VerifiedImage(Record):
    """``<root>/<hash of the image's path>.json``: the image's files hashed before, by relative path."""

    image: str  # the image directory, resolved: a record found under another image's name is not believed
    files: dict[str, Hashed]


class VerifiedDependencies(Record):
    """``<root>/dependencies.json``: host files hashed before, by absolute path (one for every image)."""

    files: dict[str, Hashed]


class HostCheck(Record):
    """A host check's verdict and the key it holds for (it is asked again under any other key)."""

    key: list[Any]
    verdict: str


class HostChecks(Record):
    """``<root>/host-checks.json``, by check name: the one kept is `criu check`'s."""

    criu: HostCheck | None = None


def identity(st: os.stat_result) -> Identity | None:
    """What must not change for a hashed file to count as still verified; None: never trust the stat."""
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        return None
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


FINE_MARGIN_NS = 100_000_000  # > one kernel tick (10 ms at HZ=100) and the coarse clock's lag
COARSE_MARGIN_NS = 2_000_000_000  # filesystems that keep whole seconds (or two: FAT)


def settled(st: os.stat_result, statted_at_ns: int) -> bool:
    """Was the file's last change far enough before its stat (taken at ``statted_at_ns``, or
    later) that any later write must change its ctime?"""
    margin = COARSE_MARGIN_NS if st.st_ctime_ns % 1_000_000_000 == 0 else FINE_MARGIN_NS
    return st.st_ctime_ns < statted_at_ns - margin


SETTLE_MAX_S = 0.5  # the most a pull waits for the files it just wrote to be old enough to record


def wait_settled(stats: Callable[[], Iterable[os.stat_result]], max_s: float = SETTLE_MAX_S) -> int:
    """Wait, at most ``max_s``, until every stat ``stats()`` gives (asked again each time) is
    settled; the time taken before the last stats, for the record (``statted_at_ns``). Files just
    written or renamed into place are otherwise left out of a record and hashed again later."""
    deadline = time.monotonic() + max_s
    while True:
        now = time.time_ns()
        if all(settled(st, now) for st in stats()) or time.monotonic() >= deadline:
            return now
        time.sleep(0.02)


def _record_path(image_dir: Path, root: Path) -> Path:
    return root / (hashlib.sha256(os.fsencode(image_dir.resolve())).hexdigest()[:32] + ".json")


def _private(path: Path) -> bool:
    st = os.lstat(path)
    return st.st_uid == os.geteuid() and not st.st_mode & 0o077 and not stat.S_ISLNK(st.st_mode)


def load(image_dir: Path, root: Path = VERIFIED_DIR) -> dict[str, Hashed]:
    """rel path -> what was hashed of it before; {} when unknown (read_cache: no record, or none
    believed)."""
    cached = read_cache(root, _record_path(image_dir, root).name, VerifiedImage)
    return dict(cached.files) if cached is not None and cached.image == str(image_dir.resolve()) else {}


def still_verified(record: dict[str, Hashed], rel: str, st: os.stat_result, sha256: str) -> bool:
    known = record.get(rel)
    now = identity(st)
    return known is not None and now is not None and known.identity == now and known.sha256 == sha256


def _hashed(name: str, ident: Identity, digest: str) -> Hashed | None:
    """The entry of a file just hashed; None where a record cannot hold it (a name that is not
    valid text, an inode number past 63 bits): that file is only hashed again next time."""
    if not is_plain(name):
        return None
    try:
        return Hashed(identity=ident, sha256=digest)
    except RecordError:
        return None


def remember(image_dir: Path, digests: dict[str, tuple[os.stat_result, str]], root: Path = VERIFIED_DIR,
             statted_at_ns: int | None = None) -> None:
    """Record files just hashed: rel path -> (their stat taken before hashing, the sha256 that
    matched the manifest); ``statted_at_ns``: a time before those stats were taken (default: now,
    for stats taken just before this call). A file whose stat changed meanwhile, or that changed
    too shortly before its stat (settled), is not recorded."""
    at = time.time_ns() if statted_at_ns is None else statted_at_ns
    files = {}
    for rel, (before, digest) in digests.items():
        ident = identity(before)
        try:
            if ident is None or not settled(before, at) or identity(os.lstat(image_dir / rel)) != ident:
                continue
        except OSError:
            continue
        if (entry := _hashed(rel, ident, digest)) is not None:
            files[rel] = entry
    try:
        record = VerifiedImage(image=str(image_dir.resolve()), files=files)
    except RecordError:
        return  # an image path that is not valid text: its files are hashed every time
    write_cache(root, _record_path(image_dir, root).name, record)


def writable_root(root: Path) -> bool:
    """Make ``root`` (and its missing ancestors) as make_trusted_dirs does, never through another
    user's directory or link (VSNAP_RUNTIME_DIR may put it under /tmp); True if it is root's
    private directory, where a cache may be written."""
    from vsnap.protocol.errors import ImageUntrusted

    from .trust import make_trusted_dirs

    try:
        make_trusted_dirs(root)
        return _private(root)
    except (ImageUntrusted, OSError):
        return False  # someone else's directory: never trust, never write


def read_cache(root: Path, name: str, model: type[R]) -> R | None:
    """The record ``root/name``, or None: absent, not exactly ``model``'s shape (protocol.records),
    a link, or in a directory or a file that is not root's alone (a record anyone else could have
    written is no record). Never an error: only a cache."""
    try:
        if not (_private(root) and _private(root / name)):
            return None
        data = control.read_bytes(root, name)  # never through a link, bounded
        return None if data is None else model.model_validate_json(data)
    except (OSError, ControlProtocolError, RecordError):
        return None


def write_cache(root: Path, name: str, record: Record) -> None:
    """Write ``record`` as ``root/name`` (atomically), only if ``root`` is (or is made) root's
    private directory (writable_root). A failure is not an error: the next run computes again."""
    try:
        if writable_root(root):
            control.write_atomic(root, name, record.model_dump_json().encode())
    except OSError:
        pass


def forget(image_dir: Path, root: Path = VERIFIED_DIR) -> None:
    """Remove the record of ``image_dir``: inside ``root`` only if it is root's private directory
    (opened without following a link, then checked), never through a link someone else made."""
    record = _record_path(image_dir, root)
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return  # no cache (or not a directory of its own): nothing of ours to forget
    try:
        st = os.fstat(fd)
        if st.st_uid == os.geteuid() and not st.st_mode & 0o077:
            os.unlink(record.name, dir_fd=fd)
    except FileNotFoundError:
        pass
    finally:
        os.close(fd)


# Host files a restored tree depends on (its mapped libraries, the model's files), by absolute
# path: hashed at capture, by `vsnap validate IMAGE` or by a restore, and remembered by identity
# like image files, so a restore checks their sha256 against the manifest without reading them
# again. One record for every image (the files are the host's, not an image's).
DEPENDENCIES = "dependencies.json"


def load_dependencies(root: Path = VERIFIED_DIR) -> dict[str, Hashed]:
    """path -> what was hashed of that host file before; {} when unknown (read_cache)."""
    cached = read_cache(root, DEPENDENCIES, VerifiedDependencies)
    return dict(cached.files) if cached is not None else {}


def dependency_verified(record: dict[str, Hashed], path: str, st: os.stat_result, sha256: str) -> bool:
    """``path`` (``st``: its stat, following links) was hashed to ``sha256`` and has not changed since."""
    return still_verified(record, path, st, sha256)


def remember_dependencies(digests: dict[str, tuple[os.stat_result, str]], root: Path = VERIFIED_DIR,
                          statted_at_ns: int | None = None) -> None:
    """Record host files just hashed: path -> (their stat, following links, taken before hashing;
    their sha256); ``statted_at_ns`` as for remember. A file whose stat changed meanwhile, or that
    had not settled, is not recorded; what was recorded before for other paths is kept (a
    concurrent writer may drop an entry: it is only hashed again)."""
    at = time.time_ns() if statted_at_ns is None else statted_at_ns
    files = load_dependencies(root)
    for path, (before, digest) in digests.items():
        ident = identity(before)
        try:
            if ident is None or not settled(before, at) or identity(os.stat(path)) != ident:
                files.pop(path, None)
                continue
        except OSError:
            continue
        if (entry := _hashed(path, ident, digest)) is not None:
            files[path] = entry
        else:
            files.pop(path, None)
    write_cache(root, DEPENDENCIES, VerifiedDependencies(files=files))


# Host checks whose verdict cannot change while the kernel runs (`criu check`), by name: the
# verdict and the key it holds for (the boot, the kernel, the checked binary's identity).
HOST_CHECKS = "host-checks.json"


def host_check_passed(name: Literal["criu"], key: list[Any], root: Path = VERIFIED_DIR) -> str | None:
    """The verdict of check ``name`` remembered for ``key``, or None (never checked, another key,
    or no record believed: read_cache)."""
    checks = read_cache(root, HOST_CHECKS, HostChecks)
    check: HostCheck | None = getattr(checks, name) if checks is not None else None
    return check.verdict if check is not None and check.key == key else None


def remember_host_check(name: Literal["criu"], key: list[Any], verdict: str, root: Path = VERIFIED_DIR) -> None:
    """Keep check ``name``'s ``verdict`` for ``key`` (the other checks' as they were)."""
    checks = read_cache(root, HOST_CHECKS, HostChecks) or HostChecks()
    try:
        checks = checks.model_copy(update={name: HostCheck(key=key, verdict=verdict)})
    except RecordError:
        return  # a key that is not valid text: the check is only asked again
    write_cache(root, HOST_CHECKS, checks)
