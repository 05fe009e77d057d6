"""Which directories vsnap may use as an image or control directory: absolute, clean (no '..', no
control characters), not a system directory, not one reached through a symlink to one.

Its own module (not _spec's) so that a restore, a pull and `vsnap images` check a manifest's or a
command line's directory without importing the spec's schema and YAML loader.
"""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath

from vsnap.protocol.errors import HostNotReady, ImageUntrusted

DEFAULT_IMAGE_ROOT = Path("/var/lib/vsnap/images")
DEFAULT_CONTROL_ROOT = Path("/run/vsnap")
# vsnap's own records on this host: instances, captures, the caches of verified and pushed files
# (VSNAP_RUNTIME_DIR moves them; a value that is not a clean absolute directory of its own is
# refused by require_runtime_dir, and meanwhile the default is used)
DEFAULT_RUNTIME_DIR = Path("/run/vsnap")

# Directories that a spec may never name as its image or control directory: a capture with
# --force replaces the image directory, and the control directory is made private (0700) and
# mounted over inside the tree. The directories themselves are refused ...
SYSTEM_DIRS = frozenset({
    "/", "/bin", "/boot", "/dev", "/etc", "/home", "/lib", "/lib32", "/lib64", "/libx32", "/lost+found",
    "/media", "/mnt", "/opt", "/proc", "/root", "/run", "/run/lock", "/run/user", "/sbin", "/snap", "/srv",
    "/sys", "/tmp", "/usr", "/var", "/var/backups", "/var/cache", "/var/lib", "/var/local", "/var/lock",
    "/var/log", "/var/mail", "/var/opt", "/var/run", "/var/spool", "/var/tmp",
    # vsnap's own roots: every image, every instance record, the built-in model
    str(DEFAULT_IMAGE_ROOT.parent), str(DEFAULT_IMAGE_ROOT), str(DEFAULT_CONTROL_ROOT), "/var/lib/vsnap/models",
})
# ... and so is anything below these (the kernel's, devices, configuration, the OS).
SYSTEM_TREES = ("/proc", "/sys", "/dev", "/etc", "/usr", "/boot", "/bin", "/sbin", "/lib", "/lib32", "/lib64",
                "/libx32")


PATH_MAX = 4096


def require_plain_path(path: str, what: str) -> None:
    """A path a record or a manifest names and vsnap stats, removes or hands to CRIU: absolute, at
    most PATH_MAX characters, no NUL (ValueError, which a record turns into its error)."""
    if not path.startswith("/") or "\0" in path or len(path) > PATH_MAX:
        raise ValueError(f"{what} must be an absolute path of at most {PATH_MAX} characters, without NUL")


def absolute_clean(value: str, what: str) -> str:
    path = Path(value)
    if not path.is_absolute():
        raise ValueError(f"{what} must be an absolute path (got {value!r})")
    if ".." in path.parts:
        raise ValueError(f"{what} must not contain '..' (got {value!r})")
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise ValueError(f"{what} must not contain control characters such as newlines (got {value!r})")
    return value


def _system_reason(path: str) -> str | None:
    """Why ``path`` (absolute, normalized) is a system directory, or None."""
    if path in SYSTEM_DIRS:
        return f"{path} is a system directory"
    parts = PurePosixPath(path).parts
    if len(parts) == 3 and parts[1] == "home":
        return f"{path} is a home directory"
    if len(parts) == 4 and parts[1:3] == ("run", "user"):
        return f"{path} is a user's runtime directory"
    for tree in SYSTEM_TREES:
        if path.startswith(tree + "/"):
            return f"{path} is inside {tree}, a system directory"
    return None


def refuse_system_path(value: str, what: str, use: str) -> str:
    """Refuse a system directory (or one reached through a symlink) as the image or control directory.

    ``value`` is absolute without '..'. Symlinks in it are resolved as far as they exist, so a link
    to /etc is refused like /etc.
    """
    path = "/" + os.path.normpath(value).lstrip("/")  # POSIX keeps a leading "//"
    reason = _system_reason(path)
    if reason is None:
        real = os.path.realpath(path)
        if real != path and (inner := _system_reason(real)):
            reason = f"{path} resolves to {real} through a symlink, and {inner}"
    if reason:
        raise ValueError(f"{reason}; {what} must be a directory of its own ({use})")
    return value


def require_safe_directory(value: str, what: str) -> None:
    """For paths that do not come through a spec (``--image``, a manifest's control_dir): absolute,
    clean, not a system directory; else ImageUntrusted in one line."""
    try:
        refuse_system_path(absolute_clean(value, what), what, "choose a directory of its own")
    except ValueError as exc:
        raise ImageUntrusted(value, str(exc), hint="choose a directory of its own") from None


def _runtime_dir(value: str | None) -> tuple[Path, str | None]:
    """(the runtime directory, why VSNAP_RUNTIME_DIR=value is refused or None)."""
    if value is None or (value.startswith("/") and "/" + os.path.normpath(value).lstrip("/") == str(DEFAULT_RUNTIME_DIR)):
        return DEFAULT_RUNTIME_DIR, None  # the default, however spelled (/run/vsnap/, //run/vsnap)
    try:
        refuse_system_path(absolute_clean(value, "VSNAP_RUNTIME_DIR"), "VSNAP_RUNTIME_DIR", "vsnap's records")
    except ValueError as exc:
        return DEFAULT_RUNTIME_DIR, str(exc)
    return Path("/" + os.path.normpath(value).lstrip("/")), None


RUNTIME_DIR, RUNTIME_DIR_PROBLEM = _runtime_dir(os.environ.get("VSNAP_RUNTIME_DIR"))


def require_runtime_dir() -> None:
    """Refuse (HostNotReady, one line) a VSNAP_RUNTIME_DIR that is not a clean absolute directory
    of its own: the records there decide which processes vsnap stops and what it removes."""
    if RUNTIME_DIR_PROBLEM is not None:
        raise HostNotReady("runtime dir", RUNTIME_DIR_PROBLEM,
                           hint="set VSNAP_RUNTIME_DIR to an absolute directory of its own (e.g. /run/vsnap-test), "
                                "or unset it")
