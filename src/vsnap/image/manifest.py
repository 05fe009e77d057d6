"""manifest.json: what an image holds and what a restore depends on, readable without the payload."""

from __future__ import annotations

import errno
import json
import os
import re
import stat
from pathlib import Path
from typing import Any, Literal

from vsnap.host.facts import HostFacts
from vsnap.host.paths import PATH_MAX, require_plain_path
from vsnap.host.trust import open_following_only_roots_links
from vsnap.protocol.control import LaunchConfig
from vsnap.protocol.errors import ImageError, ImageFormatError, ImageIncompatible, ImageUntrusted
from vsnap.protocol.oracle import Oracle
from vsnap.protocol.records import Record, RecordError, field
from vsnap.protocol.version import PROTOCOL_VERSION, __version__

# 2: protocol_version and vsnap_version recorded; the launch settings are the manifest's own model
FORMAT_VERSION = 2
MANIFEST = "manifest.json"
CRIU_DIR = "criu"
SHM_DIR = "shm"
# private directories of a vLLM tree inside its control directory (IPC sockets, TMPDIR)
TREE_DIRS = ("rpc", "tmp")
WEIGHTS_DIR = "weights"  # vllm: the loaded parameters, one flat file per rank (engine/adapters/vllm/weights/)
LOGS_DIR = "logs"
DUMP_LOG = "logs/dump.log"
ENGINE_LOG = "logs/engine.log"
MAX_MANIFEST_BYTES = 16 << 20
MAX_BYTES = (1 << 63) - 1  # a size or byte count in the manifest (off_t's range)
CRIU_KEY = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # a CRIU external key (host.criu.options.external_mounts: m0, m1...)
CAPTURED = "captured"  # Manifest.origin of an image made by `vsnap capture`
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # the spec's name (spec/schema.py), the image's
MAX_SHOWN = 1024  # the longest version, date, hostname, origin a manifest may hold: commands print them
# a GPU's UUID as host.cuda._format_uuid writes it (the CUDA restore's GPU map parses it back to 16 bytes)
GPU_UUID = re.compile(r"GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


class _Frozen(Record):
    """Frozen, and read only if it has exactly its fields (protocol.records: no pydantic, which
    every restore would import before its first phase)."""


PIECES_SCHEME = "sha256-of-64MiB-pieces"


class FileEntry(_Frozen):
    """``digest`` by ``scheme``: "sha256" (the file's sha256, what sha256sum prints) for a file of
    at most 64 MiB; PIECES_SCHEME for a larger one: the sha256 of the concatenated hex sha256 of its
    64 MiB pieces, so verification runs on every core. docs/image-format.md gives the shell
    command that reproduces it."""

    size: int = field(ge=0, le=MAX_BYTES)
    digest: str
    scheme: Literal["sha256", "sha256-of-64MiB-pieces"]


class Dependency(_Frozen):
    """A host file the tree had mapped or open at capture."""

    path: str
    size: int = field(ge=0, le=MAX_BYTES)
    sha256: str | None = None  # restore checks sizes; `vsnap validate IMAGE` checks contents too

    def _check(self) -> None:
        require_plain_path(self.path, "a dependency's path")


class ImageLaunch(_Frozen):
    """What the captured tree was launched with (the manifest's own copy, not a control message:
    the control protocol may change without changing what an image says)."""

    engine: str
    model: str
    served_model_name: str
    serve_args: dict[str, Any] = field(default_factory=dict)
    oracle_prompts: list[str]
    oracle_max_tokens: int
    oracle_top_k: int
    oracle_tolerance: float
    timeout_s: float
    weights_dir: str | None = None

    @classmethod
    def of(cls, launch: LaunchConfig) -> "ImageLaunch":
        return cls(**launch.model_dump(include=set(cls.field_names())))


class Manifest(_Frozen):
    format_version: int
    protocol_version: int              # the engine contract of the code inside the image (protocol.control)
    vsnap_version: str                 # the vsnap that captured it
    created_at: str
    name: str
    engine: str
    spec: dict[str, Any]
    launch: ImageLaunch
    control_dir: str                   # the path the tree sees; each instance binds its own directory there
    control_mount_key: str             # the CRIU external key of that bind mount
    shm_mount_key: str                 # the key of the tree's /dev/shm (a per-instance directory too)
    netns_key: str                     # the tree's network namespace: external, a fresh one per restore
    oracle: Oracle
    host: HostFacts
    externals: dict[str, str]          # CRIU mount key -> mount point
    shm_files: list[str] = field(default_factory=list)  # link-remap files to put back in the tree's /dev/shm
    cuda_processes: int = field(default=0, ge=0, le=64)  # processes whose CUDA state was checkpointed
    # vllm: tensor_parallel_size (one worker process per GPU) and the GPUs the ranks ran on, in rank
    # order (CUDA ordinal order inside the tree). Optional: an image captured before the fields is
    # one rank on host.gpus[0] (captured_gpus).
    tensor_parallel_size: int = field(default=1, ge=1, le=8)
    gpu_uuids: list[str] = field(default_factory=list)
    gpu_memory_required: int | None = field(default=None, ge=0, le=MAX_BYTES)  # free GPU memory a restore needs (vLLM's share once awake)
    dependencies: list[Dependency] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)
    processes: list[dict[str, Any]] = field(default_factory=list)  # pid, command, anonymous_bytes at the dump
    files: dict[str, FileEntry]        # every other file of the image, relative path -> size and sha256
    # where the image came from: "captured" (by `vsnap capture` on this or another host), or the
    # registry reference `vsnap pull` fetched it from (REGISTRY/REPOSITORY:TAG or ...@sha256:DIGEST).
    # Optional: images written before the field read as captured. Informational only: nothing is
    # trusted because of it (`vsnap images` shows it).
    origin: str = CAPTURED

    def _check(self) -> None:
        """One GPU per rank, each named by its UUID; CRIU's keys plain words and the paths it is
        given plain absolute paths (they reach its command line), the model directory's too (a
        pull writes there); file names without NUL."""
        if not NAME.fullmatch(self.name):
            raise ValueError("name must be a spec's name: 1 to 64 of A-Z a-z 0-9 . _ -, first a letter or digit")
        shown = {"vsnap_version": self.vsnap_version, "created_at": self.created_at, "engine": self.engine,
                 "origin": self.origin, **{f"host.{k}": v for k, v in self.host.model_dump().items() if isinstance(v, str)}}
        for what, value in shown.items():  # commands print them: one printable line, not a page
            if len(value) > MAX_SHOWN or not value.isprintable():
                raise ValueError(f"{what} must be at most {MAX_SHOWN} printable characters (no newline, no control "
                                 "or invisible character)")
        for key in (self.control_mount_key, self.shm_mount_key, self.netns_key, *self.externals):
            if not CRIU_KEY.fullmatch(key):
                raise ValueError("a CRIU external key must be 1 to 64 of A-Z a-z 0-9 _ . -")
        require_plain_path(self.control_dir, "control_dir")
        # the model directory: a pull may write into it (--model-dir), messages and hints name it
        require_plain_path(self.launch.model, "launch.model")
        if not self.launch.model.isprintable() or ".." in self.launch.model.split("/"):
            raise ValueError("launch.model must be a path without control characters or '..'")
        for mountpoint in self.externals.values():
            require_plain_path(mountpoint, "an external mount point")
        for name in (*self.files, *self.shm_files):
            if "\0" in name or len(name) > PATH_MAX:
                raise ValueError(f"a file name must be at most {PATH_MAX} characters, without NUL")
        if self.gpu_uuids and (len(self.gpu_uuids) != self.tensor_parallel_size
                               or len(set(self.gpu_uuids)) != len(self.gpu_uuids)):
            raise ValueError(f"gpu_uuids must name {self.tensor_parallel_size} different GPUs, one per rank")
        if not all(isinstance(u, str) and GPU_UUID.fullmatch(u) for u in self.captured_gpus()):
            raise ValueError("gpu_uuids (or host.gpus[0].uuid) must be GPU UUIDs (GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx)")
        if self.cuda_processes and len(self.captured_gpus()) != self.tensor_parallel_size:
            raise ValueError(f"an image with CUDA state of {self.tensor_parallel_size} rank(s) must name the GPU of each "
                             "(gpu_uuids, or host.gpus for one rank)")

    def model_files(self) -> dict[str, Dependency]:
        """The dependencies inside the model directory (launch.model), by their path there: what
        `vsnap push --model` sends beside the image and `vsnap pull --model-dir` puts back."""
        root = self.launch.model.rstrip("/") + "/"
        return {dep.path[len(root):]: dep for dep in self.dependencies
                if dep.path.startswith(root) and len(dep.path) > len(root)}

    def captured_gpus(self) -> list[str]:
        """The UUIDs of the GPUs the tree ran on, in rank order (empty without CUDA state)."""
        if self.gpu_uuids:
            return list(self.gpu_uuids)
        return [self.host.gpus[0].get("uuid")] if self.host.gpus and self.cuda_processes else []  # type: ignore[list-item]


def read_manifest(image_dir: Path) -> Manifest:
    """Parse and version-check manifest.json alone (no payload is read)."""
    path = image_dir / MANIFEST
    if not image_dir.is_dir():
        raise ImageError(f"{image_dir} is not an image directory", hint="capture one with `vsnap capture SPEC`")

    try:
        fd = open_following_only_roots_links(image_dir / MANIFEST)  # never through another user's link
    except ImageUntrusted:
        raise
    except FileNotFoundError:
        raise ImageFormatError(f"{image_dir} has no {MANIFEST}: not a vsnap image, or an unfinished one") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ImageFormatError(f"{path} is a symlink; an image's manifest must be a regular file") from None
        raise ImageFormatError(f"{path} cannot be read: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ImageFormatError(f"{path} is not a regular file")
        if st.st_size > MAX_MANIFEST_BYTES:
            raise ImageFormatError(f"{path} holds {st.st_size} bytes; a manifest holds at most {MAX_MANIFEST_BYTES}",
                                   hint="the manifest was altered; capture again")
        data = os.read(fd, MAX_MANIFEST_BYTES + 1)
    finally:
        os.close(fd)
    try:
        raw = json.loads(data)
    except (ValueError, RecursionError):  # RecursionError: JSON nested too deep
        raw = None
    # The version first, from the raw document: another version may have other fields.
    version = raw.get("format_version") if isinstance(raw, dict) else None
    if isinstance(version, int) and not isinstance(version, bool) and version != FORMAT_VERSION:
        host = raw.get("host") if isinstance(raw.get("host"), dict) else {}
        # from a document nothing has checked yet: printable, one line, short
        recorded = str(raw.get("vsnap_version") or host.get("vsnap") or "unknown")[:64]
        recorded = recorded.encode("utf-8", "backslashreplace").decode("ascii", "backslashreplace")
        version = max(min(version, 10**6), -1)
        error = ImageIncompatible("vsnap", f"{recorded} (image format {version})",
                                  f"vsnap {__version__} (image format {FORMAT_VERSION})")
        error.format_version = version
        raise error
    try:
        manifest = Manifest.model_validate_json(data)
    except RecordError as exc:
        raise ImageFormatError(f"{path} is malformed ({exc.where}: {exc.msg})",
                               hint="the manifest was altered or truncated; capture again") from None
    if manifest.protocol_version != PROTOCOL_VERSION:  # (vsnap_version: printable and bounded, by _check)
        raise ImageIncompatible("vsnap", f"{manifest.vsnap_version} (engine protocol {manifest.protocol_version})",
                                f"vsnap {__version__} (engine protocol {PROTOCOL_VERSION})")
    return manifest


