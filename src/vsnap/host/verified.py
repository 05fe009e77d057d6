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
under /run (tmpfs): a reboot forgets it, and the next restore hashes everything again.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import time
from pathlib import Path

from vsnap.protocol.control import write_atomic

from .paths import RUNTIME_DIR

VERIFIED_DIR = RUNTIME_DIR / "verified"

Identity = list[int]


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


def _record_path(image_dir: Path, root: Path) -> Path:
    return root / (hashlib.sha256(os.fsencode(image_dir.resolve())).hexdigest()[:32] + ".json")


def _private(path: Path) -> bool:
    st = os.lstat(path)
    return st.st_uid == os.geteuid() and not st.st_mode & 0o077 and not stat.S_ISLNK(st.st_mode)


def load(image_dir: Path, root: Path = VERIFIED_DIR) -> dict[str, dict]:
    """rel path -> {"identity": [...], "sha256": ...} of files hashed before; {} when unknown."""
    record = _record_path(image_dir, root)
    try:
        if not (_private(root) and _private(record)):
            return {}  # a record anyone else could have written is no record
        data = json.loads(record.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("image") != str(image_dir.resolve()):
        return {}
    files = data.get("files")
    return files if isinstance(files, dict) else {}


def still_verified(record: dict[str, dict], rel: str, st: os.stat_result, sha256: str) -> bool:
    known = record.get(rel)
    now = identity(st)
    return bool(known) and now is not None and known.get("identity") == now and known.get("sha256") == sha256


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
        files[rel] = {"identity": ident, "sha256": digest}
    _write_record(root, _record_path(image_dir, root).name, {"image": str(image_dir.resolve()), "files": files})


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


def _write_record(root: Path, name: str, document: dict) -> None:
    """Write a record into ``root`` (made 0700 if missing), only if it is root's private directory."""
    try:
        if writable_root(root):
            write_atomic(root, name, json.dumps(document).encode())
    except OSError:
        pass  # only a cache: the next restore hashes again


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


def load_dependencies(root: Path = VERIFIED_DIR) -> dict[str, dict]:
    """path -> {"identity": [...], "sha256": ...} of host files hashed before; {} when unknown."""
    record = root / DEPENDENCIES
    try:
        if not (_private(root) and _private(record)):
            return {}
        data = json.loads(record.read_text())
    except (OSError, ValueError):
        return {}
    files = data.get("files") if isinstance(data, dict) else None
    return files if isinstance(files, dict) else {}


def dependency_verified(record: dict[str, dict], path: str, st: os.stat_result, sha256: str) -> bool:
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
        files[path] = {"identity": ident, "sha256": digest}
    _write_record(root, DEPENDENCIES, {"files": files})


# Host checks whose verdict cannot change while the kernel runs (`criu check`), by name: the
# verdict and the key it holds for (the boot, the kernel, the checked binary's identity).
HOST_CHECKS = "host-checks.json"


def host_check_passed(name: str, key: list, root: Path = VERIFIED_DIR) -> str | None:
    """The verdict of check ``name`` remembered for ``key``, or None (never checked, another key,
    or a record someone else could have written)."""
    record = root / HOST_CHECKS
    try:
        if not (_private(root) and _private(record)):
            return None
        data = json.loads(record.read_text())
    except (OSError, ValueError, RecursionError):
        return None
    entry = data.get(name) if isinstance(data, dict) else None
    if not isinstance(entry, dict) or entry.get("key") != key or not isinstance(entry.get("verdict"), str):
        return None
    return entry["verdict"]


def remember_host_check(name: str, key: list, verdict: str, root: Path = VERIFIED_DIR) -> None:
    record = root / HOST_CHECKS
    try:
        data = json.loads(record.read_text()) if _private(root) and _private(record) else {}
    except (OSError, ValueError, RecursionError):
        data = {}
    data = data if isinstance(data, dict) else {}
    data[name] = {"key": key, "verdict": verdict}
    _write_record(root, HOST_CHECKS, data)
