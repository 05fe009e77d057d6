"""Typed CRIU settings and the one place that turns them into CRIU's command line.

Every argv starts with the action and NO_DEFAULT_CONFIG: CRIU otherwise reads
/etc/criu/default.conf and ~/.criu/default.conf first, so a stray file on the host would change
what vsnap asks for (the runner also drops CRIU_CONFIG_FILE and CRIU's other variables from the
environment, which that flag does not cover).

Every mount of the tree's mount namespace other than / and /proc belongs to the host: the dump
declares each one external under a stable key (m0, m1, ...), the manifest records the keys, and
the restore maps each key back to its mount point (runc does the same with its mount keys).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

# Mounts the tree owns itself: its root (a copy of the host's in a new mount namespace) and
# the private /proc that `unshare --mount-proc` gave it.
OWN_MOUNTS = ("/", "/proc")
NO_DEFAULT_CONFIG = "--no-default-config"


def version_argv() -> list[str]:
    """`criu --version`"""
    return [NO_DEFAULT_CONFIG, "--version"]


def check_argv(feature: str | None = None) -> list[str]:
    """`criu check` (the kernel has what CRIU needs), or `criu check --feature NAME`."""
    return ["check", NO_DEFAULT_CONFIG] + (["--feature", feature] if feature else [])


def external_mounts(mountinfo: str) -> dict[str, str]:
    """Map a key to each mount point in a /proc/PID/mountinfo text, except the tree's own."""
    keys: dict[str, str] = {}
    seen: set[str] = set()
    for line in mountinfo.splitlines():
        fields = line.split()
        if len(fields) < 5:
            continue
        mountpoint = fields[4].replace("\\040", " ")
        if mountpoint in OWN_MOUNTS or mountpoint in seen:
            continue
        seen.add(mountpoint)
        keys[f"m{len(keys)}"] = mountpoint
    return keys


@dataclass(frozen=True)
class DumpOptions:
    pid: int
    images_dir: Path
    log_file: Path
    externals: dict[str, str] = field(default_factory=dict)  # key -> mount point
    external_netns: tuple[int, str] | None = None  # (inode, key): not dumped, provided at restore
    ghost_limit: str = "512M"
    leave_running: bool = False

    def to_argv(self) -> list[str]:
        argv = [
            "dump", NO_DEFAULT_CONFIG, "--tree", str(self.pid), "--images-dir", str(self.images_dir),
            "--log-file", str(self.log_file), "-v4",
            "--link-remap", "--file-locks", "--tcp-established", "--network-lock", "skip",
            "--ghost-limit", self.ghost_limit,
        ]
        if self.leave_running:
            argv.append("--leave-running")
        for key, mountpoint in self.externals.items():
            argv += ["--external", f"mnt[{mountpoint}]:{key}"]
        if self.external_netns:
            inode, key = self.external_netns
            argv += ["--external", f"net[{inode}]:{key}"]
        return argv


@dataclass(frozen=True)
class RestoreOptions:
    images_dir: Path
    work_dir: Path  # logs and stats go here: a restore never writes into the image
    log_file: Path
    pidfile: Path
    externals: dict[str, str] = field(default_factory=dict)  # key -> mount point
    inherit_fds: dict[int, str] = field(default_factory=dict)  # fd of this process -> external key
    # memory pages come from a `criu lazy-pages` server (LazyPagesOptions, same work dir) on first touch
    lazy_pages: bool = False

    def to_argv(self) -> list[str]:
        argv = [
            "restore", NO_DEFAULT_CONFIG, "--images-dir", str(self.images_dir), "--work-dir", str(self.work_dir), "--log-file", str(self.log_file), "-v4",
            "--restore-detached", "--pidfile", str(self.pidfile),
            "--file-locks", "--tcp-established", "--root", "/",
        ]
        if self.lazy_pages:
            argv.append("--lazy-pages")
        for key, mountpoint in self.externals.items():
            argv += ["--external", f"mnt[{key}]:{mountpoint}"]
        for fd, key in self.inherit_fds.items():
            argv += ["--inherit-fd", f"fd[{fd}]:{key}"]
        return argv


@dataclass(frozen=True)
class LazyPagesOptions:
    """`criu lazy-pages`: serves a lazy restore's page faults from the image, then pushes the rest.
    It listens on lazy-pages.socket in ``work_dir``, where the restore (same work dir) finds it."""

    images_dir: Path
    work_dir: Path
    log_file: Path

    @property
    def socket(self) -> Path:
        return self.work_dir / "lazy-pages.socket"

    def to_argv(self) -> list[str]:
        return ["lazy-pages", NO_DEFAULT_CONFIG, "--images-dir", str(self.images_dir), "--work-dir", str(self.work_dir),
                "--log-file", str(self.log_file), "-v4"]
