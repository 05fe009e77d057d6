"""Each tree's /dev/shm, and CRIU's link-remap files in it.

A tree sees a private directory of the host's /dev/shm (`/dev/shm/vsnap-<instance>`) bound at
/dev/shm, declared external to CRIU and mapped to a fresh directory at each restore: POSIX shared
memory and semaphores of two instances never collide. A dump writes link-remap files there (for
files that were deleted but still open); they are saved with the image and put back into each
restore's directory, so one image restores any number of times, even several at once.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

SHM = Path("/dev/shm")


def instance_shm_dir(instance_id: str) -> Path:
    path = SHM / f"vsnap-{instance_id}"
    path.mkdir(mode=0o700, exist_ok=True)
    os.chmod(path, 0o700)
    return path


def link_remap_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.glob("link_remap.*"))


def put_back(saved_dir: Path, names: list[str], directory: Path) -> None:
    for name in names:
        shutil.copy2(saved_dir / name, directory / name)


def remove_instance_shm(directory: Path) -> None:
    if directory.parent == SHM and directory.name.startswith("vsnap-"):
        shutil.rmtree(directory, ignore_errors=True)
