"""What a capture or a restore needs of the container it runs in, and what confines it.

Proven in podman (tests/container/): a capture needs CAP_SYS_ADMIN (namespaces, mounts, CRIU's
dump; it covers CAP_CHECKPOINT_RESTORE and, for our own children, CAP_SYS_PTRACE) and
CAP_NET_ADMIN (the tree's loopback, CRIU's TCP repair mode); a restore also needs CAP_SYS_TIME
(CRIU sets the clock offsets of the restored time namespace). Those are checked before anything
runs (check_privileges). A seccomp filter, an AppArmor profile or a /proc the container runtime
masked break CRIU in ways a check of our own could only guess at (a custom profile may allow
everything): they are named when `criu check` fails (confinement), not refused on sight.
"""

from __future__ import annotations

from pathlib import Path

from vsnap.protocol.errors import HostNotReady

CAP_NET_ADMIN = 12
CAP_SYS_ADMIN = 21
CAP_SYS_TIME = 25

# (bit, name, why), per action
NEEDED: dict[str, tuple[tuple[int, str, str], ...]] = {
    "capture": ((CAP_SYS_ADMIN, "CAP_SYS_ADMIN", "namespaces, mounts and CRIU's dump"),
                (CAP_NET_ADMIN, "CAP_NET_ADMIN", "the tree's loopback and CRIU's TCP repair mode")),
}
NEEDED["restore"] = NEEDED["capture"] + (
    (CAP_SYS_TIME, "CAP_SYS_TIME", "CRIU sets the clock offsets of the restored time namespace"),)

GRANT_HINT = ("grant it to the container (Kubernetes: securityContext.capabilities.add, or privileged: true; "
              "docs/fleet.md, \"The privileges of a restoring pod\")")
STATUS = Path("/proc/self/status")
MOUNTINFO = Path("/proc/self/mountinfo")
APPARMOR = (Path("/proc/self/attr/apparmor/current"),)  # not attr/current: SELinux writes its label there
# mounts under /proc that a fresh procfs mount tolerates: kernel filesystems on its empty directories
HARMLESS_PROC_MOUNTS = ("/proc/sys/fs/binfmt_misc",)


def _status_field(name: str, status: Path) -> str | None:
    try:
        text = status.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key == name:
            return value.strip()
    return None


def effective_capabilities(status: Path = STATUS) -> int | None:
    value = _status_field("CapEff", status)
    try:
        return int(value, 16) if value is not None else None
    except ValueError:
        return None


def missing_capabilities(action: str, status: Path = STATUS) -> list[tuple[str, str]]:
    """(name, why) of each capability ``action`` ("capture" or "restore") needs that this process lacks."""
    have = effective_capabilities(status)
    if have is None:
        return []  # no /proc/self/status to read: CRIU will say what it lacks
    return [(name, why) for bit, name, why in NEEDED[action] if not have >> bit & 1]


def check_privileges(action: str, status: Path = STATUS) -> str:
    missing = missing_capabilities(action, status)
    if missing:
        names = ", ".join(name for name, _ in missing)
        raise HostNotReady("privileges", f"this process lacks {names}, which a {action} needs ("
                           + "; ".join(f"{name}: {why}" for name, why in missing) + ")",
                           required=names, found="missing", hint=GRANT_HINT)
    return "capabilities " + ", ".join(name for _, name, _ in NEEDED[action])


def masked_proc(mountinfo: Path = MOUNTINFO) -> list[str]:
    """Mount points under /proc (the container runtime's masks and read-only binds): with any of
    them the kernel refuses the fresh /proc that vsnap and CRIU mount for the tree."""
    try:
        lines = mountinfo.read_text().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        fields = line.split(" ")
        if len(fields) > 4 and fields[4].startswith("/proc/") and fields[4] not in HARMLESS_PROC_MOUNTS:
            found.append(fields[4].replace("\\040", " "))
    return found


def apparmor_profile(paths: tuple[Path, ...] = APPARMOR) -> str | None:
    """This process's AppArmor profile if it is confined by one (None: unconfined or no AppArmor)."""
    for path in paths:
        try:
            label = path.read_text().strip().rstrip("\x00")
        except OSError:
            continue
        if label and label != "unconfined" and not label.endswith("(unconfined)"):
            return label
        return None
    return None


def confinement(status: Path = STATUS, mountinfo: Path = MOUNTINFO,
                apparmor: tuple[Path, ...] = APPARMOR) -> list[str]:
    """What confines this process beyond its capabilities, each in a few words."""
    found = []
    if _status_field("Seccomp", status) == "2":
        found.append("a seccomp filter (Seccomp: 2 in /proc/self/status)")
    masked = masked_proc(mountinfo)
    if masked:
        shown = ", ".join(masked[:3]) + (f" and {len(masked) - 3} more" if len(masked) > 3 else "")
        found.append(f"a masked /proc ({shown} mounted over)")
    profile = apparmor_profile(apparmor)
    if profile:
        found.append(f"the AppArmor profile {profile}")
    return found


CONFINEMENT_HINT = ("run vsnap unconfined: privileged: true, or seccompProfile and appArmorProfile Unconfined "
                    "and procMount: Unmasked (podman: --security-opt seccomp=unconfined,apparmor=unconfined,"
                    "unmask=ALL); docs/fleet.md")
