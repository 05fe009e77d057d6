"""CRIU's link-remap files in /dev/shm: a dump writes them, a restore consumes them.

They are saved with the image and put back before each restore, so one image restores any
number of times, and a leftover never blocks the next dump.
"""

from __future__ import annotations

import shutil
from pathlib import Path

SHM = Path("/dev/shm")


def link_remap_files() -> list[str]:
    return sorted(p.name for p in SHM.glob("link_remap.*"))


def put_back(saved_dir: Path, names: list[str]) -> None:
    for name in names:
        shutil.copy2(saved_dir / name, SHM / name)
