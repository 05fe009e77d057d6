"""Every error vsnap raises on purpose, each with its exit code and a hint.

This module is a leaf: the CLI, the orchestrator and the engine tree all import it,
so it imports nothing from vsnap, rich, torch or vLLM.

    VsnapError               1  message, hint, log_path
    ├── SpecError            2  issues: [SpecIssue(file, line, column, field, message)]
    ├── HostNotReady         3  check, required, found
    │   └── RegistryUnavailable  registry (unreachable, refused our credentials, answered with an error)
    ├── UsageError           2  a command line that cannot apply (Click's usage errors exit 2 too)
    │   └── UnsupportedOption 11  option (e.g. --gpu for an image without CUDA state)
    ├── ImageError           4
    │   ├── ImageFormatError    format_version
    │   │   └── ImageIncompatible  recorded, current (vsnap or protocol version)
    │   ├── ImageTampered       file, expected, actual
    │   ├── ImageUntrusted      path, reason (owner, mode, symlink, a path that leaves the image)
    │   ├── ImageBusy           path (locked by a capture or restore)
    │   ├── ImageHostMismatch   mismatches: [(fact, recorded, current)]
    │   └── ArtifactError       reference, file (a registry's artifact: missing, not vsnap's, malformed,
    │                           hostile, or a blob that does not match its digest)
    ├── CheckpointError      5  phase
    │   ├── CriuError           action, returncode, log_path, excerpt
    │   ├── ProcessTreeError    pid, reason
    │   └── PhaseTimeout        phase, seconds
    ├── EngineError          6  phase, type, message (from error.json)
    │   └── OracleMismatch   7  prompt, position, expected, actual
    ├── ControlProtocolError 8  path, reason
    ├── NothingRunning       9  no instance runs (vsnap stop with nothing to stop)
    └── UnknownInstance     10  target (no image or instance of that name runs)

Ctrl-C exits 130 after teardown. Anything that is not a VsnapError is a bug.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Sequence


class VsnapError(Exception):
    """Base of every expected failure. Always raise a subclass."""

    exit_code: ClassVar[int] = 1

    def __init__(self, message: str, *, hint: str = "", log_path: Path | str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint
        self.log_path = str(log_path) if log_path else None

    def to_dict(self) -> dict[str, Any]:
        """The JSON form the CLI prints with --json."""
        return {
            "error": type(self).__name__,
            "message": self.message,
            "hint": self.hint or None,
            "log_path": self.log_path,
            "exit_code": self.exit_code,
        }


@dataclass(frozen=True)
class SpecIssue:
    """One problem in a model.yaml, located at its line and column (1-based)."""

    file: str
    line: int | None
    column: int | None
    field: str
    message: str

    def __str__(self) -> str:
        where = self.file
        if self.line is not None:
            where += f":{self.line}"
            if self.column is not None:
                where += f":{self.column}"
        return f"{where} {self.field}: {self.message}" if self.field else f"{where} {self.message}"


class SpecError(VsnapError):
    """The model.yaml is invalid. Exit code 2, like a usage error."""

    exit_code = 2

    def __init__(self, issues: Sequence[SpecIssue], *, hint: str = "") -> None:
        self.issues = list(issues)
        first = str(self.issues[0]) if self.issues else "invalid spec"
        more = f" (and {len(self.issues) - 1} more)" if len(self.issues) > 1 else ""
        super().__init__(first + more, hint=hint or "fix the spec; docs/model-yaml.md lists every key")

    def to_dict(self) -> dict[str, Any]:
        data = super().to_dict()
        data["issues"] = [issue.__dict__ | {"text": str(issue)} for issue in self.issues]
        return data


class HostNotReady(VsnapError):
    """This host lacks something vsnap needs (CRIU, root, a sysctl, a GPU)."""

    exit_code = 3

    def __init__(self, check: str, message: str, *, required: str = "", found: str = "", hint: str = "") -> None:
        super().__init__(message, hint=hint)
        self.check, self.required, self.found = check, required, found


class ImageError(VsnapError):
    """The image cannot be used: missing, malformed, altered or from another host."""

    exit_code = 4


class ImageFormatError(ImageError):
    def __init__(self, message: str, *, format_version: int | None = None, hint: str = "") -> None:
        super().__init__(message, hint=hint)
        self.format_version = format_version


class ImageTampered(ImageError):
    def __init__(self, file: str, expected: str, actual: str) -> None:
        super().__init__(
            f"image file {file} does not match the manifest (expected {expected}, found {actual})",
            hint="the image was altered or damaged; capture it again",
        )
        self.file, self.expected, self.actual = file, expected, actual


class ImageIncompatible(ImageFormatError):
    """The image was written by a vsnap whose engine contract this one does not speak."""

    def __init__(self, what: str, recorded: str, current: str, *, hint: str = "") -> None:
        super().__init__(f"image was captured by {what} {recorded}; this vsnap speaks {current}",
                         hint=hint or "restore it with the vsnap that captured it, or capture it again with this one")
        self.what, self.recorded, self.current = what, recorded, current


class ImageUntrusted(ImageError):
    """Root would act on a file that someone else could have chosen: refused before anything runs."""

    def __init__(self, path: Path | str, reason: str, *, hint: str = "") -> None:
        super().__init__(f"{path}: {reason}", hint=hint or (
            "an image must be root's alone: chown -R root:root and chmod -R go-w it (and its parents), "
            "or capture it again"))
        self.path, self.reason = str(path), reason


class ImageBusy(ImageError):
    """Another vsnap holds the image's lock (a capture replacing it, or a restore reading it)."""

    def __init__(self, path: Path | str, message: str, *, hint: str = "") -> None:
        super().__init__(message, hint=hint or "wait for the other vsnap to finish")
        self.path = str(path)


def _printable(text: str) -> str:
    """``text`` with what it must not show as it is (str.isprintable) escaped as repr() would."""
    return text if text.isprintable() else "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


class ImageHostMismatch(ImageError):
    """Facts the image depends on differ on this host. Every one is named, each on its own line:
    the first on the error line when there is one, else a count there and one per line below."""

    def __init__(self, mismatches: Sequence[tuple[str, str, str]], *, hint: str = "") -> None:
        self.mismatches = list(mismatches)
        # the fact names a file (an image's dependency path): a newline in it must not make a line
        lines = [f"{_printable(fact)}: image has {rec!r}, host has {cur!r}" for fact, rec, cur in self.mismatches]
        if len(lines) == 1:
            text = f"image does not fit this host: {lines[0]}"
        else:
            text = f"image does not fit this host in {len(lines)} facts:" + "".join(f"\n  {line}" for line in lines)
        super().__init__(
            text,
            hint=hint or "restore on a host with the same software, or capture a new image here "
                         "(docs/image-format.md, \"Restoring on another host\", says why each fact counts)",
        )

    def to_dict(self) -> dict[str, Any]:
        data = super().to_dict()
        data["mismatches"] = [{"fact": f, "recorded": r, "current": c} for f, r, c in self.mismatches]
        return data


class RegistryUnavailable(HostNotReady):
    """An OCI registry could not be used: unreachable, refused our credentials, or answered an error."""

    def __init__(self, registry: str, message: str, *, hint: str = "") -> None:
        super().__init__("registry", message, hint=hint)
        self.registry = registry


class ArtifactError(ImageError):
    """What a registry holds under a reference is not a vsnap image this vsnap will take: missing,
    another kind of artifact, malformed, naming paths outside the image, too large, or a blob whose
    bytes do not match its digest (``file``: the image file it was to become)."""

    def __init__(self, reference: str, message: str, *, file: str | None = None, hint: str = "") -> None:
        super().__init__(message, hint=hint or "push the image again from a host that holds it intact")
        self.reference, self.file = reference, file


class UsageError(VsnapError):
    """The command line asks for something that cannot apply. Exit code 2, like Click's usage errors."""

    exit_code = 2


class UnsupportedOption(UsageError):
    """An option that the target cannot honour (never ignored silently)."""

    exit_code = 11

    def __init__(self, option: str, message: str, *, hint: str = "") -> None:
        super().__init__(message, hint=hint or f"leave out {option}")
        self.option = option


class CheckpointError(VsnapError):
    """Capturing or restoring the process tree failed."""

    exit_code = 5

    def __init__(self, message: str, *, phase: str = "", hint: str = "", log_path: Path | str | None = None) -> None:
        super().__init__(message, hint=hint, log_path=log_path)
        self.phase = phase


class CriuError(CheckpointError):
    def __init__(
        self, action: str, returncode: int, log_path: Path | str, excerpt: str, hint: str = ""
    ) -> None:
        super().__init__(f"criu {action} failed: {_first_error(excerpt) or f'exit code {returncode}'}", phase=action, hint=hint, log_path=log_path)
        self.action, self.returncode, self.excerpt = action, returncode, excerpt


# CRIU logs these as errors but goes on; they never explain a failure.
_BENIGN_CRIU_ERRORS = ("RLIMIT_NOFILE", "Restoring FAILED", "Dumping FAILED")


def _first_error(excerpt: str) -> str:
    """The first CRIU error line that explains something, without its timestamp and source position."""
    lines = [line for line in excerpt.splitlines() if line.strip()]
    for line in lines:
        if "Error" in line and not any(b in line for b in _BENIGN_CRIU_ERRORS):
            return line.split("):", 1)[-1].strip() if "):" in line else line.strip()
    return lines[-1].strip() if lines else ""


class ProcessTreeError(CheckpointError):
    def __init__(self, pid: int | None, reason: str, *, phase: str = "", log_path: Path | str | None = None,
                 hint: str = "") -> None:
        super().__init__(reason, phase=phase, log_path=log_path, hint=hint)
        self.pid, self.reason = pid, reason


class PhaseTimeout(CheckpointError):
    def __init__(self, phase: str, seconds: float, *, log_path: Path | str | None = None) -> None:
        super().__init__(
            f"{phase} did not finish within {seconds:g} s",
            phase=phase,
            hint="read the engine log; raise snapshot.timeout_s if the engine is just slow",
            log_path=log_path,
        )
        self.seconds = seconds


class EngineError(VsnapError):
    """The engine tree reported a failure in error.json (or died without one)."""

    exit_code = 6

    def __init__(self, phase: str, type_: str, message: str, *, log_path: Path | str | None = None,
                 hint: str = "") -> None:
        super().__init__(f"engine failed during {phase}: {type_}: {message}", hint=hint or "read the engine log",
                         log_path=log_path)
        self.phase, self.type, self.engine_message = phase, type_, message


class OracleMismatch(EngineError):
    """After restore the engine no longer computes what it computed before capture."""

    exit_code = 7

    def __init__(self, prompt: int, position: int, expected: str, actual: str, *,
                 log_path: Path | str | None = None) -> None:
        super().__init__(
            "recover",
            "OracleMismatch",
            f"prompt {prompt}, token {position}: expected {expected}, got {actual}",
            log_path=log_path,
            hint="the restored engine is not the captured one; the server was not opened",
        )
        self.prompt, self.position, self.expected, self.actual = prompt, position, expected, actual


class ControlProtocolError(VsnapError):
    """A control file or directory is unsafe or malformed (symlink, mode, owner, content)."""

    exit_code = 8

    def __init__(self, path: Path | str, reason: str) -> None:
        super().__init__(f"{path}: {reason}", hint="remove it, or use a private control directory you own")
        self.path, self.reason = str(path), reason


class NothingRunning(VsnapError):
    """There is no running instance at all (``vsnap stop`` with nothing to stop)."""

    exit_code = 9

    def __init__(self, message: str = "no vsnap instance is running", *, hint: str = "") -> None:
        super().__init__(message, hint=hint or "vsnap ps lists running instances; vsnap restore IMAGE starts one")


class UnknownInstance(VsnapError):
    """Instances run, but none is the image or instance id named."""

    exit_code = 10

    def __init__(self, target: str, *, hint: str = "") -> None:
        super().__init__(f"no running instance of {target}", hint=hint or "vsnap ps lists the running instances")
        self.target = target


class InstanceNotStandby(UnknownInstance):
    """`vsnap activate` named an instance that runs but is not standing by."""

    def __init__(self, instance_id: str, state: str) -> None:
        VsnapError.__init__(self, f"instance {instance_id} is {state}, not a standby",
                            hint="vsnap ps shows each instance's state; only a standby "
                                 "(`vsnap restore IMAGE --standby`) can be activated")
        self.target, self.state = instance_id, state


class ImageChanged(ImageError):
    """A standby's image was replaced (captured again) after the standby was restored from it."""

    def __init__(self, image: Path | str, instance_id: str) -> None:
        super().__init__(f"{image} was captured again after standby {instance_id} was restored from it",
                         hint=f"vsnap stop {instance_id}, then restore a standby of the new image")
        self.image = str(image)
