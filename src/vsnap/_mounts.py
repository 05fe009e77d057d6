"""What every process on the host has mounted, from /proc/PID/mountinfo: a directory vsnap made
for a tree (its /dev/shm, its control directory) is in use while any process has it bound, even
when no record this vsnap can read names it."""

from __future__ import annotations

import os


def mount_roots(mount_point: str | None = None) -> set[str]:
    """The root (field 4: the directory of its filesystem that is mounted) of every mount some
    process sees, or only of those mounted at ``mount_point``."""
    roots: set[str] = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/mountinfo", "rb") as f:  # paths are bytes: any user may mount "\xff"
                for line in f:
                    fields = [os.fsdecode(field) for field in line.split()]
                    if len(fields) > 4 and (mount_point is None or fields[4] == mount_point):
                        roots.add(fields[3])
        except OSError:
            continue
    return roots
