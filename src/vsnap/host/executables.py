"""The programs vsnap starts, each resolved once to an absolute path that only root could have put there.

vsnap runs as root, so a program it starts by name runs as root too: a `criu` that another user
put first on PATH (a directory of theirs, or one they may write to) would be run by `vsnap
validate` with root's rights. So every external program (criu, unshare, sh, mount) is found here,
once per process, and used by its absolute path: the file, a link to it and every directory above
both must be root's and not writable by group or others (host.trust.untrusted_file: the rule the
image trust model applies to the files root relies on). A program that fails the rule is refused
in one line naming it (HostNotReady); vsnap never looks further along PATH for another one, since
the PATH that put it first is the problem. Entries of PATH that are not absolute (``.``, an empty
entry: the current directory) are skipped, as a root shell's secure path would.

The Python interpreter that runs vsnap (``sys.executable``, used to start the engine) is not
checked here: it already runs vsnap's own code with root's rights, so it is trusted as that code is.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from vsnap.protocol.errors import HostNotReady

from .trust import untrusted_file

EXECUTABLE_HINT = ("root runs only programs root owns: chown root and chmod go-w the program and every directory "
                   "above it, or put a root-owned one first on PATH")

_resolved: dict[tuple[str, str, str], Path] = {}  # (name, PATH, explicit path) -> the checked path


def search_path(environ: dict[str, str] | None = None) -> list[str]:
    """The absolute directories of PATH, in order (relative entries name the current directory: skipped)."""
    value = (os.environ if environ is None else environ).get("PATH", os.defpath)
    return [entry for entry in value.split(os.pathsep) if entry.startswith("/")]


def _first_on_path(name: str, directories: list[str]) -> Path | None:
    """The first ``directory/name`` that is an executable regular file (as the shell would run)."""
    for directory in directories:
        candidate = Path(directory) / name
        try:
            st = os.stat(candidate)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode) and os.access(candidate, os.X_OK):
            return candidate
    return None


def require_root_owned_executable(path: Path, name: str, *, source: str) -> Path:
    """``path`` (absolute) if root may run it: an executable regular file that is root's alone,
    below directories that are root's alone (host.trust.untrusted_file); else one HostNotReady line
    naming it and why. ``source`` says where the path came from (``on PATH``, ``VSNAP_CRIU``)."""
    if not path.is_absolute():
        raise HostNotReady(name, f"{source} names {path}, not an absolute path; vsnap runs programs only by "
                                 "absolute path", hint=EXECUTABLE_HINT)
    problem = untrusted_file(path)
    if problem is None and not (path.is_file() and os.access(path, os.X_OK)):
        problem = "not an executable file"
    if problem is not None:
        raise HostNotReady(name, f"refusing to run {path} ({source}) as root: {problem}", found=str(path),
                           hint=EXECUTABLE_HINT)
    return path


def resolve_executable(name: str, *, explicit_env: str | None = None, fallbacks: tuple[str, ...] = (),
                       missing_hint: str = "") -> Path:
    """The absolute path of program ``name``, checked once per process (and again only if PATH or the
    override changes): ``$explicit_env`` if that variable is set, else the first ``name`` on PATH's
    absolute directories, else the first of ``fallbacks`` that exists. Raises HostNotReady when it is
    missing (with ``missing_hint``) or not root's alone."""
    explicit = os.environ.get(explicit_env, "") if explicit_env else ""
    key = (name, os.environ.get("PATH", os.defpath), explicit)
    if key in _resolved:
        return _resolved[key]
    if explicit:
        path = require_root_owned_executable(Path(explicit), name, source=f"{explicit_env}={explicit}")
    else:
        found, source = _first_on_path(name, search_path()), "first on PATH"
        if found is None:
            found, source = _first_on_path(name, [str(Path(f).parent) for f in fallbacks if Path(f).name == name]), \
                "vsnap's default"
        if found is None:
            raise HostNotReady(name, f"{name} is not installed (not on PATH)", found="none", hint=missing_hint)
        path = require_root_owned_executable(found, name, source=source)
    _resolved[key] = path
    return path


def forget_resolved() -> None:
    """Drop what resolve_executable remembered (tests that change the files behind a path)."""
    _resolved.clear()
