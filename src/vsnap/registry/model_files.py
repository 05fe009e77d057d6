"""The model's files as blobs beside an image: `vsnap push --model` sends them, `vsnap pull
--model-dir DIR` puts them back where the image needs them.

An image depends on every file of its model directory by absolute path (manifest.json's
``dependencies``, each with its size and sha256; the restored tree reopens them there, a restore
checks them). A fresh node has neither the image nor the model, so the artifact can carry both:
one raw layer per model file (oci.MODEL_FILE_MEDIA_TYPE), titled with its path inside the model
directory, whose blob digest is the file's own sha256. Every image of one model therefore shares
the model's blobs: a second image pushes none of them (the registry holds them: HEAD), and a node
that has the model keeps it.

A pull writes into a directory a registry cannot choose: the model directory goes only where the
user names it with ``--model-dir``, which must be the path the image records (``launch.model``);
inside it, only the paths the image's dependencies name, each checked against manifest.json
(registry.oci.match_manifest). A file already there is kept if it is that file (root's alone,
same size and sha256), else the pull is refused naming it: vsnap never replaces a file it did
not write. The rest is fetched into a private staging directory inside the model directory
(``.vsnap-pull-<16 hex digits of the manifest digest>``, so each rename stays on one
filesystem), checked as it is written, and moved into place without replacing anything
(RENAME_NOREPLACE) once the whole image has been fetched and checked; then their digests are
remembered (host.verified) so the first restore does not hash the model again.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from vsnap.host import verified
from vsnap.host.fs import RENAME_NOREPLACE, renameat2
from vsnap.host.paths import require_safe_directory
from vsnap.host.trust import make_trusted_dirs, require_trusted_model
from vsnap.image.compat import dependency_mismatches
from vsnap.image.manifest import Dependency, FileEntry, Manifest
from vsnap.protocol.errors import HostNotReady, ImageError, ImageHostMismatch, ImageUntrusted, UsageError

from .oci import MODEL_STAGING_PREFIX, Artifact, Layer, Reference

SETTLE_MAX_S = 0.5  # the most a pull waits for the placed files to be old enough to record
KEEP_HINT = "vsnap never replaces a file it did not write: move it away, then pull again"


def layers_to_push(manifest: Manifest) -> dict[str, tuple[Path, Layer]]:
    """Each model file of ``manifest`` (path in the model directory -> its path on this host and
    its layer), after checking that the files are root's alone and still the ones the image was
    captured with (size and sha256; hashed only where this host has not hashed them since)."""
    files = manifest.model_files()
    model_dir = manifest.launch.model
    if not files:
        raise UsageError(f"the image records no files of its model directory {model_dir}",
                         hint="push it without --model (the image was captured before vsnap recorded its model)")
    unhashed = sorted(rel for rel, dep in files.items() if dep.sha256 is None)
    if unhashed:
        raise ImageError(f"the image records no sha256 for {model_dir}/{unhashed[0]}",
                         hint="capture the image again with this vsnap, or push it without --model")
    require_trusted_model(Path(model_dir))
    mismatches = dependency_mismatches(list(files.values()), hash_files=True, cache_root=verified.VERIFIED_DIR)
    if mismatches:
        raise ImageHostMismatch(mismatches)
    return {rel: (Path(dep.path), Layer(rel, "raw", f"sha256:{dep.sha256}", dep.size)) for rel, dep in files.items()}


def staging_name(digest: str) -> str:
    return MODEL_STAGING_PREFIX + digest.removeprefix("sha256:")[:16]


_STAGING = re.compile(re.escape(MODEL_STAGING_PREFIX) + r"[0-9a-f]{16}")


@dataclass
class ModelPlacement:
    """One pull's model files: where they go, which are there already, and the staging
    directory the others are fetched into (``entries``/``layers``: what registry.pull's
    downloads take, by path inside the model directory)."""

    model_dir: Path
    staging: Path
    entries: dict[str, FileEntry]   # the files to fetch
    layers: dict[str, Layer]
    kept: dict[str, Dependency]     # already in place, checked
    wanted: dict[str, Dependency]   # every model file

    @property
    def bytes_needed(self) -> int:
        return sum(entry.size for entry in self.entries.values())


def prepare(model_dir: Path, manifest: Manifest, artifact: Artifact) -> ModelPlacement:
    """Checks, before any blob: ``model_dir`` is the image's, a directory of root's (made if
    missing), and every model file already there is the image's; the staging directory made or
    adopted."""
    ref = str(artifact.reference)
    recorded = Path(manifest.launch.model)
    model_dir = Path(os.path.abspath(model_dir))
    if not artifact.model_layers:
        raise UsageError(f"{ref} carries no model files", hint="push the image with `vsnap push --model`, or pull "
                                                              "without --model-dir")
    if model_dir != recorded:
        raise UsageError(f"{ref} needs its model at {recorded}, not {model_dir}",
                         hint=f"pull with --model-dir {recorded}: the restored server reopens its model's files "
                              "by the path they had at capture")
    require_safe_directory(str(model_dir), "the model directory")
    make_trusted_dirs(model_dir)
    wanted = manifest.model_files()
    present = {rel: dep for rel, dep in wanted.items() if os.path.lexists(dep.path)}
    mismatches = dependency_mismatches(list(present.values()), hash_files=True, cache_root=verified.VERIFIED_DIR)
    if mismatches:
        fact, recorded_value, found = mismatches[0]
        raise HostNotReady("model", f"{fact.removeprefix('file ')} is already there and is not the image's model file "
                                    f"(the image's: {recorded_value}; there: {found})", hint=KEEP_HINT)
    layers = {layer.path: layer for layer in artifact.model_layers}
    missing = {rel: dep for rel, dep in wanted.items() if rel not in present}
    entries = {rel: FileEntry(size=dep.size, digest=dep.sha256 or "", scheme="sha256") for rel, dep in missing.items()}
    staging = _make_or_adopt_staging(model_dir, artifact.reference)
    return ModelPlacement(model_dir, staging, entries, {rel: layers[rel] for rel in missing}, present, wanted)


def _is_ours(path: Path) -> bool:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o077


def _make_or_adopt_staging(model_dir: Path, reference: Reference) -> Path:
    staging = model_dir / staging_name(reference.digest or "")
    for entry in os.scandir(model_dir):
        other = Path(entry.path)
        if other != staging and _STAGING.fullmatch(entry.name) and _is_ours(other):
            shutil.rmtree(other, ignore_errors=True)  # another pull's leftovers (vsnap's private directory)
            verified.forget(other)
    try:
        os.mkdir(staging, 0o700)
    except FileExistsError:
        if not _is_ours(staging):
            raise ImageUntrusted(staging, "stands where vsnap stages the model's files and is not a private "
                                          "directory of root's that vsnap made",
                                 hint=f"remove {staging} yourself if it is yours to delete") from None
    return staging


def place(placement: ModelPlacement) -> None:
    """Move the fetched files from the staging directory into the model directory, never over
    anything (a file that appeared there meanwhile is kept if it is the image's, else refused),
    remove the staging directory, and remember the model files' digests for the first restore."""
    for rel in sorted(placement.entries):
        target = placement.model_dir / rel
        if "/" in rel:
            make_trusted_dirs(target.parent)
        try:
            renameat2(placement.staging / rel, target, RENAME_NOREPLACE)
        except OSError as exc:
            if exc.errno == errno.EEXIST:
                _require_same(placement.wanted[rel])
            elif exc.errno in (errno.ENOSYS, errno.EINVAL):  # no renameat2 here: link() never replaces either
                _link_into_place(placement.staging / rel, target, placement.wanted[rel])
            else:
                raise
    shutil.rmtree(placement.staging)
    verified.forget(placement.staging)
    _remember(list(placement.wanted.values()))


def _link_into_place(source: Path, target: Path, dep: Dependency) -> None:
    try:
        os.link(source, target)
    except FileExistsError:
        _require_same(dep)


def _require_same(dep: Dependency) -> None:
    mismatches = dependency_mismatches([dep], hash_files=True, cache_root=verified.VERIFIED_DIR)
    if mismatches:
        raise HostNotReady("model", f"{dep.path} appeared while vsnap pulled it and is not the image's model file",
                           hint=KEEP_HINT)


def _remember(dependencies: list[Dependency]) -> None:
    """Record the model files' digests (checked as they were written, or before) once their last
    change is old enough for the record to take them (host.verified.settled)."""
    deadline = time.monotonic() + SETTLE_MAX_S
    while True:
        now = time.time_ns()
        stats = {dep.path: os.stat(dep.path) for dep in dependencies}
        if all(verified.settled(st, now) for st in stats.values()) or time.monotonic() >= deadline:
            break
        time.sleep(0.02)
    verified.remember_dependencies({dep.path: (stats[dep.path], dep.sha256 or "") for dep in dependencies},
                                   statted_at_ns=now)
