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
user names it with ``--model-dir``, which must be the path the image records (``launch.model``).
Since that path is the image's word (its hints tell the user to type it), it must also lie apart
from vsnap's own directories and from the image pulled, outside the trees where programs find jobs
or settings by name (NOT_MODEL_TREES, a hidden directory other than a .cache), be root's alone, and
hold nothing but that model's files; one pull at a time writes into it (a flock on it). Inside it,
only the paths the image's dependencies name, each checked against manifest.json
(registry.oci.match_manifest). A file already there is kept if it is that file (root's alone,
same size and sha256), else the pull is refused naming it: vsnap never replaces a file it did
not write. The rest is fetched into a private staging directory inside the model directory
(``.vsnap-pull-<16 hex digits of the manifest digest>``, so each rename stays on one
filesystem), checked as it is written, and moved into place without replacing anything
(RENAME_NOREPLACE) once the whole image has been fetched and checked; then their digests are
remembered (host.verified) so the first restore does not hash the model again: a file placed as it
stands then, a file kept as it stood when it was checked (one changed since is left to be hashed).
Each is checked by its plain sha256, whatever its size (a dependency's digest), never by the
64 MiB-piece digest of an image file.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import shutil
import stat
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from vsnap.host import verified
from vsnap.host.fs import RENAME_NOREPLACE, renameat2
from vsnap.host.paths import DEFAULT_IMAGE_ROOT, RUNTIME_DIR, require_safe_directory
from vsnap.host.trust import NOT_MODEL_FILES, make_trusted_dirs, require_trusted_model
from vsnap.image.compat import dependency_mismatches
from vsnap.image.manifest import Dependency, FileEntry, Manifest
from vsnap.image.store import make_or_adopt_staging_dir, require_outside_images
from vsnap.protocol.errors import (
    HostNotReady,
    ImageBusy,
    ImageError,
    ImageHostMismatch,
    ImageUntrusted,
    UsageError,
)

from .oci import MODEL_STAGING_PREFIX, Artifact, Layer, Reference, require_model_path, shown

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
    for rel in sorted(files):  # what a pull refuses as a title: refused here, before a byte is sent
        if rel.split("/", 1)[0] in NOT_MODEL_FILES:  # images captured before vsnap left them out
            raise ImageError(f"the image records {model_dir}/{shown(rel)}, not a file of the model (a clone's "
                             "history or a tool's cache, which may hold credentials)",
                             hint="capture the image again with this vsnap (it leaves them out, unless the engine "
                                  "held one open: then copy the model without them), or push without --model")
        try:
            require_model_path(rel)
        except ImageUntrusted as exc:
            raise ImageError(f"{model_dir} holds {exc.path}, a name a pull refuses ({exc.reason})",
                             hint="rename it in the model directory and capture again, or push without --model"
                             ) from None
    require_trusted_model(Path(model_dir))
    _require_model_self_contained(manifest, files)
    mismatches = dependency_mismatches(list(files.values()), hash_files=True, cache_root=verified.VERIFIED_DIR)
    if mismatches:  # other nodes would get a model the image does not restore with
        raise ImageHostMismatch(mismatches, hint="put the model back as it was captured, or capture the image again")
    return {rel: (Path(dep.path), Layer(rel, "raw", f"sha256:{dep.sha256}", dep.size)) for rel, dep in files.items()}


def _require_model_self_contained(manifest: Manifest, files: dict[str, Dependency]) -> None:
    """Refuse a model whose files are links to files outside its directory that the image also
    depends on by their own path (Hugging Face's cache: snapshots/REV/F -> ../../blobs/SHA, and
    the engine had the blob open): the pull would put F back as a file, never the blob, and the
    restore on a fresh node would miss it."""
    behind = {os.path.realpath(dep.path): rel for rel, dep in files.items() if os.path.islink(dep.path)}
    inside = {dep.path for dep in files.values()}
    for dep in manifest.dependencies:
        if dep.path not in inside and dep.path in behind:
            raise ImageError(f"the image depends on {shown(dep.path)}, the file behind {manifest.launch.model}/"
                             f"{shown(behind[dep.path])}, outside the model directory: a pull of the model would not "
                             "bring it", hint="capture the model from a directory of its own without links (e.g. "
                                              "`huggingface-cli download MODEL --local-dir DIR`), or push without "
                                              "--model and provision the model on each node")


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
    kept_stats: dict[str, os.stat_result]  # the kept files as they were when checked
    kept_at_ns: int = 0             # a time before those stats


def prepare(model_dir: Path, manifest: Manifest, artifact: Artifact, *, image_dir: Path,
            held: ExitStack) -> ModelPlacement:
    """Checks, before any blob: ``model_dir`` is the image's, apart from vsnap's own directories
    and from the image being pulled (``image_dir``), a directory of root's (made if missing) that
    holds nothing but the image's model files, each the image's; the directory locked for this
    pull (released by ``held``); the staging directory made or adopted."""
    ref = str(artifact.reference)
    recorded = Path(manifest.launch.model)
    model_dir = Path(os.path.abspath(model_dir))
    if not artifact.model_layers:
        raise UsageError(f"{ref} carries no model files", hint="push the image with `vsnap push --model`, or pull "
                                                              "without --model-dir")
    if model_dir != recorded:
        raise UsageError(f"{ref} needs its model at {shown(str(recorded))}, not {shown(str(model_dir))}",
                         hint=f"pull with --model-dir {shown(str(recorded))}: the restored server reopens its "
                              "model's files by the path they had at capture")
    require_safe_directory(str(model_dir), "the model directory")
    _require_apart(model_dir, image_dir)
    require_outside_images(model_dir, "the model directory", APART_HINT, itself=True)
    _require_no_settings(model_dir)
    make_trusted_dirs(model_dir)
    _require_roots_alone(model_dir, model_dir)
    _lock(model_dir, held)
    wanted = manifest.model_files()
    _require_only_model(model_dir, wanted)
    checked_at = time.time_ns()
    present = {rel: dep for rel, dep in wanted.items() if os.path.lexists(dep.path)}
    stats = {}  # taken before the check: a kept file is recorded as it was when it was checked (_remember)
    for rel, dep in present.items():
        try:
            stats[rel] = os.stat(dep.path)
        except OSError:
            pass  # a dangling link: the check names it
    mismatches = dependency_mismatches(list(present.values()), hash_files=True, cache_root=verified.VERIFIED_DIR)
    if mismatches:
        fact, recorded_value, found = mismatches[0]
        raise HostNotReady("model", f"{fact.removeprefix('file ')} is already there and is not the image's model file "
                                    f"(the image's: {recorded_value}; there: {found})", hint=KEEP_HINT)
    layers = {layer.path: layer for layer in artifact.model_layers}
    missing = {rel: dep for rel, dep in wanted.items() if rel not in present}
    entries = {rel: FileEntry(size=dep.size, digest=dep.sha256 or "", scheme="sha256") for rel, dep in missing.items()}
    staging = _make_or_adopt_staging(model_dir, artifact.reference)
    return ModelPlacement(model_dir, staging, entries, {rel: layers[rel] for rel in missing}, present, wanted,
                          {rel: st for rel, st in stats.items()}, checked_at)


APART_HINT = ("the image's manifest.json names that directory as its model's (launch.model): pull without "
              "--model-dir, or capture the image with its model in a directory of its own")


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _require_apart(model_dir: Path, image_dir: Path) -> None:
    """The model directory is none of vsnap's own (its records under the runtime directory, whose
    verified record a restore trusts; its image root), and neither inside the image being pulled
    (or its staging beside it) nor around it: a model file must never become, or sit among, an
    image's files."""
    spellings = {str(model_dir), os.path.realpath(model_dir)}
    image = Path(os.path.abspath(image_dir))
    images = {str(image), os.path.realpath(image)}
    for path in spellings:
        for own, what in ((str(RUNTIME_DIR), "vsnap's own records"), (str(DEFAULT_IMAGE_ROOT), "vsnap's own images")):
            if _inside(path, own) or _inside(path, os.path.realpath(own)):
                raise ImageUntrusted(model_dir, f"the model directory is inside {own} ({what}); a pull never "
                                                "writes a model there", hint=APART_HINT)
        for other in images:
            staging = str(Path(other).parent / f".{Path(other).name}.")
            if _inside(path, other) or _inside(other, path) or path.startswith(staging):
                raise ImageUntrusted(model_dir, f"the model directory and the image {image_dir} lie inside one "
                                                "another; a pull keeps a model apart from the image",
                                     hint=f"pull --to a directory outside {model_dir}" if _inside(other, path)
                                     else APART_HINT)


# Trees where programs find jobs, mail, logs or runtime state by a file's name (cron reads
# /var/spool/cron/root, systemd /run/systemd/system): never a model's directory.
NOT_MODEL_TREES = ("/run", "/var/run", "/var/spool", "/var/mail", "/var/log")
SETTINGS_HINT = ("the image's manifest.json names that directory as its model's (launch.model): if the model "
                 "really belongs there, put its files there yourself; else capture the image with its model in a "
                 "directory of its own")


def _require_no_settings(model_dir: Path) -> None:
    """The model directory is not where a program finds jobs or settings by a file's name: none of
    NOT_MODEL_TREES, and no hidden directory on its path but a cache (`.cache`, where Hugging Face
    and torch keep models): a pull must not put an image's file into /root/.ssh (authorized_keys),
    ~/.local (a .pth file Python runs) or ~/.config, whatever path an image names."""
    for path in (str(model_dir), os.path.realpath(model_dir)):
        for tree in NOT_MODEL_TREES:
            if _inside(path, tree):
                raise ImageUntrusted(model_dir, f"the model directory is inside {tree}, where programs find jobs "
                                                "and state by name; a pull never writes a model there",
                                     hint=SETTINGS_HINT)
        hidden = [part for part in Path(path).parts if part.startswith(".") and part != ".cache"]
        if hidden:
            raise ImageUntrusted(model_dir, f"the model directory is inside a hidden directory ({shown(hidden[0])}), "
                                            "where programs keep settings; a pull writes a model only under "
                                            "plain directories (or .cache)", hint=SETTINGS_HINT)


def _require_roots_alone(model_dir: Path, directory: Path) -> None:
    """A directory of the model is root's alone, as a capture requires of the model it records
    (host.trust.require_trusted_model): not writable by group or others, sticky or not (a
    crontab directory is root's, mode 1730)."""
    st = os.stat(directory)
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise ImageUntrusted(directory, f"is owned by uid {st.st_uid} with mode {stat.S_IMODE(st.st_mode):04o}: "
                                        "a model directory is root's alone (not writable by group or others)",
                             hint=f"chown root and chmod go-w {directory} if it is the model's, or {SETTINGS_HINT}")


def _lock(model_dir: Path, held: ExitStack) -> None:
    """One pull at a time puts files into a model directory (a flock on it, for the whole pull):
    another would adopt or remove the first one's staging directory under it."""
    fd = os.open(model_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    held.callback(os.close, fd)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise ImageBusy(model_dir, f"another vsnap pull is putting files into {model_dir}",
                        hint="wait for it to finish, then pull again: the model files it placed are kept") from None


def _require_only_model(model_dir: Path, wanted: dict[str, Dependency]) -> None:
    """The model directory is empty or holds nothing but files of the image's model (the directories
    on their way, this model's staging directories): a pull only completes a model, and never adds a
    file to a directory of anything else, whatever path an image names (/root/.ssh, a crontab
    directory, a site-packages). Walked without following links; stops at the first stranger."""
    on_the_way = {"/".join(rel.split("/")[:i]) for rel in wanted for i in range(1, rel.count("/") + 1)}
    device = os.stat(model_dir).st_dev
    for dirpath, dirnames, filenames in os.walk(model_dir, followlinks=False):
        where = os.path.relpath(dirpath, model_dir)
        for name in sorted(dirnames + filenames):
            rel = name if where == "." else f"{where}/{name}"
            if rel in on_the_way and name in dirnames:
                if os.path.islink(Path(dirpath) / name):  # its files would land where none of the checks above ran
                    raise HostNotReady("model", f"{model_dir / shown(rel)} is a link where the image's model has a "
                                                "directory: a pull writes a model's files only into real directories",
                                       hint=KEEP_HINT)
                _require_roots_alone(model_dir, Path(dirpath) / name)
                if os.stat(Path(dirpath) / name).st_dev != device:  # the staging is on the model directory's
                    raise HostNotReady("model", f"{model_dir / shown(rel)} is on another filesystem than "
                                                f"{model_dir}: a pull moves each model file into place with one "
                                                "rename from its staging directory there",
                                       hint="put the model directory on one filesystem, or pull without "
                                            "--model-dir and put the model's files there yourself")
                continue
            if rel in on_the_way:
                raise HostNotReady("model", f"{model_dir / shown(rel)} stands where the image's model has a "
                                            "directory and is not one", hint=KEEP_HINT)
            if where == "." and name in NOT_MODEL_FILES and not os.path.islink(Path(dirpath) / name):
                if name in dirnames:  # a clone's history, a download tool's cache: never written by a pull
                    dirnames.remove(name)
                continue
            if rel in wanted or (where == "." and _STAGING.fullmatch(name)):
                if name in dirnames:
                    dirnames.remove(name)  # a staging directory, or a model file that is a directory (refused later)
                continue
            raise HostNotReady("model", f"{model_dir} holds {shown(rel)}, which is not a file of the image's model: "
                                        "a pull puts a model only into a directory that is empty or holds nothing "
                                        "else",
                               hint=f"check the image names the right model directory (launch.model: {model_dir}); "
                                    "if it does, move what is not the model's away, then pull again")


def _make_or_adopt_staging(model_dir: Path, reference: Reference) -> Path:
    staging = model_dir / staging_name(reference.digest or "")
    others = [Path(entry.path) for entry in os.scandir(model_dir) if _STAGING.fullmatch(entry.name)]
    return make_or_adopt_staging_dir(staging, others, "the model's files", f"remove {staging} yourself if it is yours "
                                                                        "to delete")


def place(placement: ModelPlacement, checked: dict[str, tuple[os.stat_result, str]] | None = None) -> None:
    """Move the fetched files from the staging directory into the model directory, never over
    anything (a file that appeared there meanwhile is kept if it is the image's, else refused),
    remove the staging directory, and remember the model files' digests for the first restore:
    only a file still as it was when its download checked it (``checked``: rel -> its stat then)."""
    placed: dict[str, os.stat_result] = {}
    for rel in sorted(placement.entries):
        target = placement.model_dir / rel
        if "/" in rel:
            make_trusted_dirs(target.parent)
        try:
            renameat2(placement.staging / rel, target, RENAME_NOREPLACE)
        except OSError as exc:
            if exc.errno == errno.EEXIST:
                _require_same(placement.wanted[rel])  # hashed now, and recorded by that check
                continue
            elif exc.errno in (errno.ENOSYS, errno.EINVAL):  # no renameat2 here: link() never replaces either
                if not _link_into_place(placement.staging / rel, target, placement.wanted[rel]):
                    continue
            else:
                raise
        now, was = os.lstat(target), (checked or {}).get(rel)
        if was is not None and _unchanged(was[0], now):  # the rename changed its ctime, never its content
            placed[rel] = now
    shutil.rmtree(placement.staging)
    verified.forget(placement.staging)
    _remember({placement.wanted[rel].path: (st, placement.wanted[rel].sha256 or "") for rel, st in placed.items()})
    # the kept files as they were checked: one changed since (even by root) is dropped from the record
    verified.remember_dependencies({dep.path: (placement.kept_stats[rel], dep.sha256 or "")
                                    for rel, dep in placement.kept.items() if rel in placement.kept_stats},
                                   statted_at_ns=placement.kept_at_ns)


def _unchanged(checked: os.stat_result, placed: os.stat_result) -> bool:
    """The file placed is the one checked, not written since (a write moves its mtime; the rename
    its ctime alone)."""
    return (stat.S_ISREG(placed.st_mode) and (checked.st_dev, checked.st_ino, checked.st_size, checked.st_mtime_ns)
            == (placed.st_dev, placed.st_ino, placed.st_size, placed.st_mtime_ns)
            and checked.st_ctime_ns <= placed.st_ctime_ns)


def _link_into_place(source: Path, target: Path, dep: Dependency) -> bool:
    """True: linked into place; False: the image's file was there already (checked, recorded)."""
    try:
        os.link(source, target)
    except FileExistsError:
        _require_same(dep)
        return False
    return True


def _require_same(dep: Dependency) -> None:
    mismatches = dependency_mismatches([dep], hash_files=True, cache_root=verified.VERIFIED_DIR)
    if mismatches:
        raise HostNotReady("model", f"{dep.path} appeared while vsnap pulled it and is not the image's model file",
                           hint=KEEP_HINT)


def _remember(placed: dict[str, tuple[os.stat_result, str]]) -> None:
    """Record the placed model files' digests (path -> their stat just after placing, and the sha256
    their download checked) once their last change is old enough for the record to take them
    (host.verified.settled); one changed since those stats (even by root) is left out."""
    if not placed:
        return
    statted_at = verified.wait_settled(lambda: [st for st, _ in placed.values()])
    verified.remember_dependencies(placed, statted_at_ns=statted_at)
