"""What the host's processes have mounted, from /proc/PID/mountinfo: a directory vsnap made for a
tree (its /dev/shm, its control directory) is in use while any process has it bound, even when no
record this vsnap can read names it.

Only mount namespaces of vsnap's own user namespace count (vsnap's trees never leave it; another
user's namespace can bind any name it likes, which would pin vsnap's directories for ever), and
each is read once, not once per process in it."""

from __future__ import annotations

import os


def _namespace(pid: str, kind: str) -> int | None:
    try:
        return os.stat(f"/proc/{pid}/ns/{kind}").st_ino
    except OSError:
        return None


def mount_roots(mount_point: str | None = None) -> set[str]:
    """The root (field 4: the directory of its filesystem that is mounted) of every mount a process
    of our user namespace sees, or only of those mounted at ``mount_point``."""
    ours = _namespace("self", "user")
    roots: set[str] = set()
    seen: set[int] = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or _namespace(entry, "user") != ours:
            continue
        namespace = _namespace(entry, "mnt")
        if namespace is None or namespace in seen:
            continue
        seen.add(namespace)
        try:
            with open(f"/proc/{entry}/mountinfo", "rb") as f:  # paths are bytes: any user may mount "\xff"
                for line in f:
                    fields = [os.fsdecode(field) for field in line.split()]
                    if len(fields) > 4 and (mount_point is None or fields[4] == mount_point):
                        roots.add(fields[3])
        except OSError:
            seen.discard(namespace)  # gone meanwhile: another process of it may still say
            continue
    return roots
