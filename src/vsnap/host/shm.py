"""Each tree's /dev/shm, and CRIU's link-remap files in it.

A tree sees a private directory of the host's /dev/shm (`/dev/shm/vsnap-<instance>`) bound at
/dev/shm, declared external to CRIU and mapped to a fresh directory at each restore: POSIX shared
memory and semaphores of two instances never collide. Every file the tree has there at the dump
(CRIU's link-remap files for deleted-but-open files, and shared memory the processes open by name)
is saved with the image and put back into each restore's directory, so one image restores any
number of times, even several at once.
"""

from __future__ import annotations

import os
import shutil
import stat
import time
from pathlib import Path

from vsnap.protocol.errors import ProcessTreeError

from .mounts import mount_roots
from .trust import copy_no_follow

SHM = Path("/dev/shm")


def shm_dir_of(instance_id: str) -> Path:
    return SHM / f"vsnap-{instance_id}"


def instance_shm_dir(instance_id: str) -> Path:
    """A new private directory for one tree; never one that exists already (anyone can write /dev/shm)."""
    path = shm_dir_of(instance_id)
    os.mkdir(path, 0o700)  # FileExistsError rather than adopting what someone else put there
    return path


def _ours(directory: Path) -> bool:
    """A directory vsnap made for a tree: a real directory named vsnap-*, in /dev/shm, root's, private."""
    try:
        st = os.lstat(directory)
    except (OSError, ValueError):  # absent, or no path at all (a NUL, too long)
        return False
    return (directory.parent == SHM and directory.name.startswith("vsnap-") and stat.S_ISDIR(st.st_mode)
            and st.st_uid == os.geteuid() and not st.st_mode & 0o077)


def tree_shm_files(directory: Path) -> list[str]:
    """Every file the tree left in its /dev/shm at the dump, to be saved with the image: CRIU's
    link-remap files (deleted-but-open files such as semaphores), and the POSIX shared memory and
    named semaphores its processes share by name (vLLM's `psm_*` between EngineCore and its
    worker), which CRIU reopens by path at restore. Only regular files: anything else is refused."""
    names = []
    for entry in sorted(os.scandir(directory), key=lambda e: e.name):
        if not entry.is_file(follow_symlinks=False):
            raise ProcessTreeError(None, f"the tree left {entry.path} in its /dev/shm, which is not a regular file; "
                                         "vsnap saves only files there", phase="criu dump")
        names.append(entry.name)
    return names


def put_back(saved_dir: Path, names: list[str], directory: Path) -> None:
    """Copy the saved link-remap files into a fresh tree directory (plain names, no link followed)."""
    for name in names:
        copy_no_follow(saved_dir / name, directory / name)


def remove_instance_shm(directory: Path) -> None:
    """Remove a tree's /dev/shm directory, and nothing that vsnap did not make (see _ours), nor
    one a live tree has bound (whatever a record says)."""
    if _ours(directory) and directory.name not in _mounted_names():
        shutil.rmtree(directory, ignore_errors=True)


def _mounted_names() -> set[str]:
    """Names of /dev/shm/vsnap-* directories some process has bound (a live tree's /dev/shm)."""
    return {root[1:] for root in mount_roots(str(SHM)) if root.startswith("/vsnap-")}


def remove_orphans(known: set[str], min_age_s: float = 60.0) -> list[str]:
    """Remove vsnap's /dev/shm directories that no record names and no live tree has mounted
    (left by a vsnap that was killed, or by an older version without records)."""
    candidates = [d for d in SHM.glob("vsnap-*") if d.name not in known and _ours(d)
                  and time.time() - d.lstat().st_mtime >= min_age_s]
    if not candidates:
        return []
    mounted = _mounted_names()
    removed = []
    for directory in candidates:
        if directory.name not in mounted:
            shutil.rmtree(directory, ignore_errors=True)
            removed.append(directory.name)
    return removed
