"""CriuRunner: finds CRIU, checks it, runs dump and restore, turns failures into CriuError.

The only module that executes CRIU. Arguments come from host.criu.options (each with
--no-default-config); CRIU runs with CRIU's own environment variables removed (CRIU_CONFIG_FILE is
read even with that flag, CRIU_LIBS_DIR loads plugins, CRIU_FAULT injects faults), so nothing on
the host but vsnap's argv decides what CRIU does. The exact argv of each run is saved beside its
log (``<log>.argv``) so a failure can be replayed by hand.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NoReturn

from vsnap.protocol.errors import CriuError, HostNotReady

from ..executables import resolve_executable
from ..privileges import CONFINEMENT_HINT, confinement
from .options import DumpOptions, LazyPagesOptions, RestoreOptions, check_argv, version_argv

MIN_VERSION = (4, 2)
INSTALL_HINT = "run scripts/criu/install.sh as root (builds CRIU 4.2.1), or set VSNAP_CRIU to a criu >= 4.2"

# Known CRIU messages -> what the user should do.
HINTS: tuple[tuple[str, str], ...] = (
    # first: a task OOM-killed mid-restore makes the others fail on whatever they did next
    (r"killed by signal 9\b|Killed by signal 9\b", "a process of the restore was killed (SIGKILL), most likely by the "
                                                   "OOM killer or a memory cgroup's limit: check free memory and "
                                                   "`dmesg | grep -i oom`"),
    (r"Can't fork for \d+: File exists", "a process from the earlier run still holds that PID; stop it first"),
    (r"io_uring", "sysctl -w kernel.io_uring_disabled=2 before capture; CRIU cannot dump io_uring"),
    (r"Unexpected rt vDSO area bounds", "this CRIU is too old for the kernel: " + INSTALL_HINT),
    (r"[Nn]o such file or directory", "a file the tree had open is gone; restore on the host that has it"),
    (r"File .* has bad (size|mode)", "a file the tree had open changed (size or mode) since capture; put it back or capture again"),
    (r"Can't bind|Address already in use", "the port or socket path is taken by another process"),
    # before the permission one: with a low limit CRIU's log also says "Operation not permitted"
    (r"service_fd_base|Too many open files", "the open-files limit is too low for CRIU: raise it (`ulimit -n "
                                             "65536`, or the container's nofile limit); vsnap raises its soft "
                                             "limit to the hard one itself"),
    (r"Permission denied|Operation not permitted", "CRIU needs root (CAP_SYS_ADMIN)"),
    (r"Can't dump.*(mount|mnt)|unsupported mount", "a mount of the tree is not declared external; see the dump log"),
)


def criu_environment() -> dict[str, str]:
    """This process's environment without CRIU's own variables (CRIU_*)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("CRIU_")}


def find_criu() -> Path:
    """VSNAP_CRIU, else criu on PATH, else /usr/local/bin/criu: an absolute path to a criu that is
    root's alone, file and directories (host.executables), since vsnap runs it as root; any other is
    refused, never run (not even for `criu --version`)."""
    explicit = os.environ.get("VSNAP_CRIU")
    if explicit and not (os.path.isfile(explicit) and os.access(explicit, os.X_OK)):
        raise HostNotReady("criu", f"VSNAP_CRIU={explicit} is not an executable file", hint=INSTALL_HINT)
    try:
        return resolve_executable("criu", explicit_env="VSNAP_CRIU", fallbacks=("/usr/local/bin/criu",),
                                  missing_hint=INSTALL_HINT)
    except HostNotReady as exc:
        if exc.found == "none":
            raise HostNotReady("criu", "criu is not installed", required=">= 4.2", found="none",
                               hint=INSTALL_HINT) from None
        raise


def parse_version(text: str) -> tuple[int, ...] | None:
    match = re.search(r"Version:\s*(\d+)\.(\d+)(?:\.(\d+))?", text)
    return tuple(int(g) for g in match.groups() if g is not None) if match else None


def excerpt_errors(log_path: Path, context: int = 3, limit: int = 12) -> str:
    """The error lines of a CRIU log with a little context before each; else the log's tail."""
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    keep: list[int] = []
    for i, line in enumerate(lines):
        if "Error" in line or "error" in line.split(":", 1)[0]:
            keep.extend(range(max(0, i - context), i + 1))
    if not keep:
        return "\n".join(lines[-limit:])
    ordered = sorted(set(keep))
    return "\n".join(lines[i] for i in ordered[-limit:])


KILLED_HINT = ("CRIU was killed by a signal ({name}), not refused: with SIGKILL most likely the kernel's OOM killer "
               "or a memory cgroup's limit; check free memory and `dmesg | grep -i oom`, then run it again")


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def hint_for(excerpt: str, returncode: int = 1) -> str:
    """What to do about a failed CRIU run: a CRIU killed by a signal (``returncode`` < 0, as
    subprocess reports it) was stopped from outside (an OOM kill, most often), whatever its log
    said last; else the first known message of its log."""
    if returncode < 0:
        return KILLED_HINT.format(name=_signal_name(-returncode))
    for pattern, hint in HINTS:
        if re.search(pattern, excerpt):
            return hint
    return "read the CRIU log"


@dataclass
class CriuRunner:
    binary: Path

    @classmethod
    def locate(cls) -> "CriuRunner":
        return cls(find_criu())

    def version(self) -> tuple[int, ...]:
        try:
            out = subprocess.run([str(self.binary), *version_argv()], capture_output=True, text=True, timeout=30,
                                 env=criu_environment())
        except OSError as exc:
            raise HostNotReady("criu", f"{self.binary} cannot run: {exc.strerror}", hint=INSTALL_HINT) from None
        version = parse_version(out.stdout)
        if version is None:
            raise HostNotReady("criu", f"{self.binary} --version printed no version", hint=INSTALL_HINT)
        return version

    def require_version(self) -> str:
        version = self.version()
        text = ".".join(map(str, version))
        if version[:2] < MIN_VERSION:
            raise HostNotReady("criu", f"criu {text} at {self.binary} is too old for this kernel",
                               required=">= 4.2", found=text, hint=INSTALL_HINT)
        return text

    def check(self) -> None:
        """`criu check`: the kernel has what CRIU needs."""
        try:
            out = subprocess.run([str(self.binary), *check_argv()], capture_output=True, text=True, timeout=60,
                                 env=criu_environment())
        except OSError as exc:
            raise HostNotReady("criu", f"{self.binary} cannot run: {exc.strerror}", hint=INSTALL_HINT) from None
        if out.returncode != 0:
            lines = (out.stderr + out.stdout).strip().splitlines()
            errors = [line for line in lines if "Error" in line] or lines[-1:]
            failed = f"criu check failed: {errors[-1] if errors else out.returncode}"
            confined = confinement()
            if confined:  # the likelier cause, named: CRIU's own line only says what it could not do
                raise HostNotReady("criu check", f"{failed} (vsnap runs under {' and '.join(confined)})",
                                   hint=CONFINEMENT_HINT)
            raise HostNotReady("criu check", failed,
                               hint="this kernel or container lacks a feature CRIU needs; see `criu check`")

    def _run(self, action: str, argv: list[str], log_file: Path, timeout_s: float,
             pass_fds: tuple[int, ...] = ()) -> None:
        log_file.parent.mkdir(parents=True, exist_ok=True)
        Path(f"{log_file}.argv").write_text(" ".join([str(self.binary), *argv]) + "\n")
        try:
            out = subprocess.run([str(self.binary), *argv], capture_output=True, text=True, timeout=timeout_s,
                                 stdin=subprocess.DEVNULL, pass_fds=pass_fds, env=criu_environment())
        except subprocess.TimeoutExpired:
            raise CriuError(action, -1, log_file, f"criu {action} ran longer than {timeout_s:g} s",
                            hint="the tree may be stuck in the kernel; see the log") from None
        if out.returncode != 0:
            _raise_failed(action, out.returncode, log_file, out.stderr)

    def dump(self, options: DumpOptions, timeout_s: float = 600) -> None:
        self._run("dump", options.to_argv(), options.log_file, timeout_s)

    def start_lazy_pages(self, options: LazyPagesOptions) -> "LazyPagesServer":
        return LazyPagesServer(self, options)

    def check_feature(self, feature: str) -> bool:
        """`criu check --feature NAME` (e.g. uffd-noncoop for lazy pages)."""
        try:
            out = subprocess.run([str(self.binary), *check_argv(feature)], capture_output=True, text=True,
                                 timeout=60, env=criu_environment())
        except OSError:
            return False
        return out.returncode == 0

    def restore(self, options: RestoreOptions, timeout_s: float = 600,
                on_started: Callable[[int], None] | None = None) -> int:
        """Restore detached; return the host PID of the restored root. ``on_started`` is called with
        CRIU's PID as soon as it runs, before it restores anything: the caller records it, so that if
        this process dies while CRIU runs, the instance's record still names the process that is
        about to leave a tree behind (host.instances adopts that tree)."""
        options.pidfile.unlink(missing_ok=True)
        try:
            self._run_restore(options, timeout_s, on_started)
            try:
                pid = int(options.pidfile.read_text().strip())
            except (OSError, ValueError):
                pid = 0
            if pid <= 0:  # waitpid(0 or less) would reap any child
                raise CriuError("restore", 0, options.log_file, f"no pid in {options.pidfile}")
            return pid
        finally:
            options.pidfile.unlink(missing_ok=True)

    def _run_restore(self, options: RestoreOptions, timeout_s: float,
                     on_started: Callable[[int], None] | None) -> None:
        """`criu restore`, its output in an unnamed file rather than a pipe: if this process dies
        while CRIU runs, CRIU must not die of a write to a pipe no one reads (SIGPIPE) half-way
        through a restore. Any exception here (a timeout, Ctrl-C) kills CRIU, as subprocess.run would."""
        argv = [str(self.binary), *options.to_argv()]
        options.log_file.parent.mkdir(parents=True, exist_ok=True)
        Path(f"{options.log_file}.argv").write_text(" ".join(argv) + "\n")
        with tempfile.TemporaryFile() as output:
            process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=output, stderr=output,
                                       pass_fds=tuple(options.inherit_fds), env=criu_environment())
            try:
                if on_started is not None:
                    on_started(process.pid)
                returncode = process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
                raise CriuError("restore", -1, options.log_file, f"criu restore ran longer than {timeout_s:g} s",
                                hint="the tree may be stuck in the kernel; see the log") from None
            except BaseException:
                process.kill()
                process.wait()
                raise
            if returncode != 0:
                output.seek(0)
                _raise_failed("restore", returncode, options.log_file, output.read(64 << 10).decode(errors="replace"))


def _raise_failed(action: str, returncode: int, log_file: Path, output: str) -> NoReturn:
    """CriuError for a failed run: its log's error lines (else what it printed) and the hint for them;
    a CRIU killed by a signal says so first (its log's last words then explain nothing)."""
    excerpt = excerpt_errors(log_file) or output.strip()
    if returncode < 0:
        excerpt = f"Error (vsnap): criu itself was killed by {_signal_name(-returncode)}\n{excerpt}"
    raise CriuError(action, returncode, log_file, excerpt, hint=hint_for(excerpt, returncode))


class LazyPagesServer:
    """A running `criu lazy-pages`. It exits by itself once every page reached the restored tree;
    until then the tree depends on it (a page it never sends blocks its process), so it runs in
    its own session (a closed terminal does not take it down) and is only ever killed with the tree."""

    def __init__(self, runner: CriuRunner, options: LazyPagesOptions, start_timeout_s: float = 10) -> None:
        self.options = options
        options.log_file.parent.mkdir(parents=True, exist_ok=True)
        argv = [str(runner.binary), *options.to_argv()]
        Path(f"{options.log_file}.argv").write_text(" ".join(argv) + "\n")
        self.process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL, start_new_session=True,
                                        env=criu_environment())
        deadline = time.monotonic() + start_timeout_s
        while not options.socket.exists():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.kill()
                excerpt = excerpt_errors(options.log_file) or "it did not open its socket"
                raise CriuError("lazy-pages", self.process.returncode or -1, options.log_file, excerpt,
                                hint="`criu check --feature uffd-noncoop` says whether this kernel can; "
                                     "restore without --lazy-pages")
            time.sleep(0.002)

    def wait(self, timeout_s: float) -> bool:
        """True once it exited (every page delivered); False if still running after ``timeout_s``."""
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return False
        return True

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
