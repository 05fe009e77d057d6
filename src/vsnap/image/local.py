"""Local images: list the images under the image roots, and remove one that vsnap made.

Every entry under a root is treated as hostile: links are never followed (a link is reported,
not listed), an entry is listed only when it passes the trust model (host.trust: root's alone, no
link, FIFO or device inside, every file listed by its manifest) and its manifest reads (bounded,
image.manifest). Nothing is hashed: `vsnap validate IMAGE` does that.

`remove_image` deletes only what vsnap made: a trusted image directory whose manifest lists every
file in it. It holds the image's capture lock and its readers' lock (both exclusive, not waited
for), refuses while an instance restored from it runs, then renames the directory to a private
name beside it (`.NAME.rm-XXXXXXXX`, never replacing anything) and deletes, through directory
fds and without following links, the files the manifest lists (the manifest last) and then the
directories. An interrupted removal leaves only that hidden directory; the next `vsnap rm` of the
same path finishes it.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import secrets
import stat
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterator, Sequence

from vsnap.host import verified
from vsnap.host.fs import RENAME_NOREPLACE, renameat2
from vsnap.host.instances import InstanceRecord, running_instances
from vsnap.host.paths import DEFAULT_IMAGE_ROOT, require_safe_directory
from vsnap.host.trust import require_inside, require_trusted_ancestors, require_trusted_tree
from vsnap.protocol.errors import ImageBusy, ImageError, ImageTampered, ImageUntrusted, VsnapError

from .manifest import CRIU_DIR, LOGS_DIR, MANIFEST, MAX_MANIFEST_BYTES, SHM_DIR, WEIGHTS_DIR, read_manifest
from .origin import read_origin
from .store import capture_lock_path, held_lock, readers_lock_path

DEFAULT_ROOTS: tuple[Path, ...] = (DEFAULT_IMAGE_ROOT,)
MAX_ENTRIES = 10_000  # entries looked at in one root; a root of images holds a few dozen
IMAGE_DIRS = frozenset({CRIU_DIR, SHM_DIR, WEIGHTS_DIR, LOGS_DIR})  # what a capture makes inside an image
RM_INFIX = ".rm-"

Instances = Callable[[], list[InstanceRecord]]


@dataclass(frozen=True)
class ImageInfo:
    """One trusted image, as its manifest describes it (sizes as found on disk)."""

    path: str
    name: str
    engine: str
    model: str  # the model directory the tree loaded (the built-in cpu model's too)
    size_bytes: int  # the files' sizes
    disk_bytes: int  # what they take on disk (sparse files, such as vLLM's shared-memory rings, take less)
    files: int
    created_at: str
    origin: str  # "captured", or the registry reference it was pulled from
    format_version: int
    instances: list[str] = field(default_factory=list)  # ids of running instances restored from it


@dataclass(frozen=True)
class SkippedEntry:
    """An entry under a root that is not listed, and why (untrusted, malformed, a link...)."""

    path: str
    reason: str


@dataclass(frozen=True)
class ImageListing:
    roots: list[str]
    images: list[ImageInfo]
    skipped: list[SkippedEntry]


@dataclass(frozen=True)
class RemovedImage:
    path: str
    name: str | None          # the manifest's name (None when only an interrupted removal was finished)
    files: int                # files deleted
    size_bytes: int           # their bytes
    finished: list[str] = field(default_factory=list)  # leftovers of interrupted removals completed on the way


# --- listing ---------------------------------------------------------------------------------------


def list_images(dirs: Sequence[Path] = (), *, instances: Instances | None = None) -> ImageListing:
    """The images found under ``dirs`` (each an image, or a directory of images), else under the
    default root(s). A directory named in ``dirs`` must exist; a missing default root lists nothing."""
    from vsnap.host.facts import check_root

    check_root()  # "root's alone" means this process's user's: as anyone else, nothing would be trusted
    explicit = bool(dirs)
    roots = [Path(os.path.abspath(d)) for d in dirs] if explicit else list(DEFAULT_ROOTS)
    images: list[ImageInfo] = []
    skipped: list[SkippedEntry] = []
    by_image = _instances_by_image(instances)
    for root in roots:
        try:
            st = os.lstat(root)
        except FileNotFoundError:
            if explicit:
                raise ImageError(f"{root} does not exist", hint="give a directory of images, or an image") from None
            continue
        candidates, found_skipped = _candidates(root, st)
        skipped += found_skipped
        for candidate in candidates:
            try:
                info = inspect_image(candidate)
            except VsnapError as exc:
                skipped.append(SkippedEntry(str(candidate), _reason(exc, candidate)))
                continue
            images.append(replace(info, instances=by_image.get(os.path.realpath(candidate), [])))
    return ImageListing([str(r) for r in roots], images, skipped)


def _reason(exc: VsnapError, path: Path) -> str:
    """The error's message without the path it starts with (the listing names the path)."""
    message = exc.message
    for prefix in (f"{path}: ", f"{path} "):
        if message.startswith(prefix):
            return message[len(prefix):]
    return message


def _candidates(root: Path, st: os.stat_result) -> tuple[list[Path], list[SkippedEntry]]:
    """The directories under ``root`` that claim to be images (hold a manifest.json), and the
    entries reported instead of listed. ``root`` itself may be an image."""
    if stat.S_ISLNK(st.st_mode):
        return [], [SkippedEntry(str(root), "is a symlink; vsnap never follows one (give the real path)")]
    if not stat.S_ISDIR(st.st_mode):
        return [], [SkippedEntry(str(root), "is not a directory")]
    try:
        require_trusted_ancestors(root / MANIFEST)  # root itself and every directory above it
    except ImageUntrusted as exc:
        return [], [SkippedEntry(str(root), f"{exc.message}")]
    if _has_manifest(root):
        return [root], []
    candidates, skipped = [], []
    try:
        with os.scandir(root) as entries:
            names = []
            for entry in entries:
                names.append(entry.name)
                if len(names) > MAX_ENTRIES:
                    skipped.append(SkippedEntry(str(root), f"holds more than {MAX_ENTRIES} entries; the first "
                                                           f"{MAX_ENTRIES} were looked at"))
                    names.pop()
                    break
    except OSError as exc:
        return [], [SkippedEntry(str(root), f"cannot be listed: {exc.strerror}")]
    for name in sorted(names):
        path = root / name
        try:
            entry_st = os.lstat(path)
        except FileNotFoundError:
            continue  # removed meanwhile
        leftover = _RM_LEFTOVER.match(name)
        if leftover and stat.S_ISDIR(entry_st.st_mode):
            image = root / leftover.group(1)
            skipped.append(SkippedEntry(str(path), f"is what an interrupted `vsnap rm` left; "
                                                   f"`vsnap rm {image}` finishes it"))
            continue
        if name.startswith("."):
            continue  # vsnap's locks, staging directories of captures in flight, and other hidden files
        if stat.S_ISLNK(entry_st.st_mode):
            skipped.append(SkippedEntry(str(path), "is a symlink; vsnap never follows one"))
        elif stat.S_ISDIR(entry_st.st_mode) and _has_manifest(path):
            candidates.append(path)
    return candidates, skipped


_RM_LEFTOVER = re.compile(r"^\.(.+)\.rm-[0-9a-f]{8}$", re.DOTALL)


def _has_manifest(directory: Path) -> bool:
    """Whether ``directory`` has an entry named manifest.json (not followed, not read)."""
    try:
        os.lstat(directory / MANIFEST)
    except OSError:
        return False
    return True


def inspect_image(image_dir: Path) -> ImageInfo:
    """What `vsnap images` shows of one image, after the checks that need no hashing: the trust
    model, the manifest (bounded read, this format version) and every file present, listed and of
    its recorded size. Raises ImageError (ImageUntrusted, ImageFormatError, ImageTampered)."""
    found = require_trusted_tree(image_dir)  # before a byte of it is read
    manifest = read_manifest(image_dir)
    for rel in manifest.files:
        require_inside(rel, "manifest 'files'")
    present = set(found) - {MANIFEST}
    unlisted = sorted(present - set(manifest.files))
    if unlisted:
        raise ImageTampered(unlisted[0], "no such file", "an unlisted file")
    st = os.lstat(image_dir / MANIFEST)
    total, disk = st.st_size, st.st_blocks * 512
    for rel, entry in sorted(manifest.files.items()):
        if rel not in present:
            raise ImageTampered(rel, f"{entry.size} bytes", "missing")
        st = os.lstat(image_dir / rel)
        if st.st_size != entry.size:
            raise ImageTampered(rel, f"{entry.size} bytes", f"{st.st_size} bytes")
        total += st.st_size
        disk += st.st_blocks * 512
    return ImageInfo(path=str(image_dir), name=manifest.name, engine=manifest.engine,
                     model=manifest.launch.model, size_bytes=total, disk_bytes=disk,
                     files=len(manifest.files) + 1, created_at=manifest.created_at,
                     origin=read_origin(image_dir) or manifest.origin,
                     format_version=manifest.format_version)


def _instances_by_image(instances: Instances | None) -> dict[str, list[str]]:
    """Running instances' ids by the real path of the image they were restored from (``instances``:
    where the records come from, by default the registry)."""
    found: dict[str, list[str]] = {}
    for record in (instances or running_instances)():
        found.setdefault(os.path.realpath(record.image), []).append(record.id)
    return found


# --- removal ---------------------------------------------------------------------------------------


def image_path(target: str) -> Path:
    """IMAGE as `vsnap rm` takes it: a path, or a bare name (no `/`) for DEFAULT_IMAGE_ROOT/NAME."""
    if not target or "\0" in target:
        raise ImageError(f"{target!r} is not an image path", hint="give the image's directory (vsnap images lists them)")
    if ".." in Path(target).parts:
        raise ImageError(f"{target}: an image path must not contain '..'", hint="give the image's real path")
    if "/" not in target and target != ".":
        return DEFAULT_IMAGE_ROOT / target
    return Path(os.path.abspath(target))


def remove_image(target: str | Path, *, instances: Instances | None = None) -> RemovedImage:
    """Remove the image ``target`` names (see image_path), and finish removals of it that were
    interrupted. Refused (ImageError, exit 4) unless it is a vsnap image of root's alone whose
    manifest lists every file in it, while a capture or a restore holds its locks, and while an
    instance restored from it runs (ImageBusy)."""
    from vsnap.host.facts import check_root

    check_root()
    image_dir = image_path(str(target))
    require_safe_directory(str(image_dir), "the image")  # never /, /var/lib/vsnap/images, ...
    require_trusted_ancestors(image_dir)  # nobody but root can rename anything on the way
    try:
        st = os.lstat(image_dir)
    except FileNotFoundError:
        st = None
    if st is None:
        finished, problems = finish_interrupted(image_dir)
        if not finished:
            if problems:
                raise problems[0]
            raise ImageError(f"{image_dir} does not exist", hint="vsnap images lists the images")
        return RemovedImage(str(image_dir), None, 0, 0, finished)
    if stat.S_ISLNK(st.st_mode):
        raise ImageUntrusted(image_dir, "is a symlink; vsnap rm removes an image directory, never a link or "
                                        "what it points to", hint="remove the link itself if it is yours")
    if not stat.S_ISDIR(st.st_mode):
        raise ImageError(f"{image_dir} is not an image directory; vsnap rm removes only images",
                         hint="vsnap images lists the images")
    _raw_manifest(image_dir)  # not an image: refused before lock files are made beside it
    with exclusive_locks(image_dir):
        busy = _instances_by_image(instances).get(os.path.realpath(image_dir), [])
        if busy:
            raise ImageBusy(image_dir, f"{image_dir} is in use: instance{'s' if len(busy) > 1 else ''} "
                                       f"{', '.join(busy)} run{'' if len(busy) > 1 else 's'} from it",
                            hint=f"vsnap stop {image_dir} first (vsnap ps lists them)")
        files, dirs, name = recognize(image_dir)  # again, now that no capture or restore can change it
        size = sum(os.lstat(image_dir / rel).st_size for rel in files)
        staging = _rename_away(image_dir)
        verified.forget(image_dir)  # what this host hashed of it: a new image at this path is hashed anew
        _delete(staging, files, dirs)
    finished, _ = finish_interrupted(image_dir)  # one it cannot recognize stays (vsnap images reports it)
    return RemovedImage(str(image_dir), name, len(files), size, finished)


@contextmanager
def exclusive_locks(image_dir: Path) -> Iterator[None]:
    """The image's capture lock, then its readers' lock, both exclusive and not waited for (the
    order a capture's publish takes them in)."""
    capture_lock, readers_lock = capture_lock_path(image_dir), readers_lock_path(image_dir)
    with held_lock(capture_lock, fcntl.LOCK_EX, 0, lambda: ImageBusy(
            capture_lock, f"a vsnap capture is writing {image_dir}", hint="wait for it to finish, then vsnap rm again")), \
            held_lock(readers_lock, fcntl.LOCK_EX, 0, lambda: ImageBusy(
                readers_lock, f"a vsnap restore is reading {image_dir}",
                hint="wait for it to finish (or vsnap stop it), then vsnap rm again")):
        yield


def recognize(image_dir: Path) -> tuple[list[str], list[str], str | None]:
    """What vsnap made in ``image_dir``: (files, directories, the manifest's name). Files are every
    file in it, the manifest last; each must be listed by a vsnap manifest (of any format version:
    an old image is removable too), and every directory must hold such files or be one a capture
    makes. Refuses (before anything is deleted) a directory that is not root's alone or not a
    vsnap image, and any entry vsnap did not make."""
    raw = _raw_manifest(image_dir)  # before walking: `vsnap rm /somewhere/big` stops here
    found = require_trusted_tree(image_dir)
    listed = raw["files"]
    for rel in listed:
        require_inside(str(rel), "manifest 'files'")
    files = sorted(rel for rel in found if rel != MANIFEST)
    for rel in files:
        if rel not in listed:
            raise ImageError(f"{image_dir} holds {rel}, which its manifest does not list; vsnap rm removes only "
                             "what vsnap made", hint="move it out (or remove the image yourself), then vsnap rm again")
    needed = {str(parent) for rel in files for parent in Path(rel).parents if str(parent) != "."}
    dirs = []
    for dirpath, dirnames, _ in os.walk(image_dir, followlinks=False):
        for name in dirnames:
            rel = str((Path(dirpath) / name).relative_to(image_dir))
            if rel not in needed and rel not in IMAGE_DIRS:
                raise ImageError(f"{image_dir} holds the directory {rel}, which no file of its manifest is in; "
                                 "vsnap rm removes only what vsnap made",
                                 hint="move it out (or remove the image yourself), then vsnap rm again")
            dirs.append(rel)
    name = raw.get("name")
    return files + [MANIFEST], sorted(dirs, key=lambda d: -d.count("/")), name if isinstance(name, str) else None


def _raw_manifest(image_dir: Path) -> dict:
    """The manifest as JSON, of any format version: a dict with an int format_version and a dict
    of files. Bounded, never through a link."""
    not_image = ImageError(f"{image_dir} is not a vsnap image (no vsnap manifest.json); vsnap rm removes only "
                           "images vsnap made", hint="remove it yourself if it is yours to delete")
    try:
        fd = os.open(image_dir / MANIFEST, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ImageUntrusted(image_dir / MANIFEST, "is a symlink; nothing in an image may be a link") from None
        raise not_image from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_MANIFEST_BYTES:
            raise not_image
        raw = json.loads(os.read(fd, MAX_MANIFEST_BYTES + 1) or b"null")
    except (ValueError, RecursionError):  # RecursionError: JSON nested too deep
        raise not_image from None
    finally:
        os.close(fd)
    if not (isinstance(raw, dict) and isinstance(raw.get("format_version"), int) and isinstance(raw.get("files"), dict)):
        raise not_image
    return raw


def _rename_noreplace(source: Path, destination: Path) -> None:
    """Rename, never replacing what stands at ``destination`` (RENAME_NOREPLACE; where the C
    library or the filesystem lacks it, a check first: the name is fresh and random)."""
    try:
        renameat2(source, destination, RENAME_NOREPLACE)
        return
    except OSError as exc:
        if exc.errno not in (errno.ENOSYS, errno.EINVAL):  # EINVAL: a filesystem without RENAME_NOREPLACE
            raise
    if os.path.lexists(destination):  # a fresh random name: only a racing root could have made it
        raise OSError(errno.EEXIST, os.strerror(errno.EEXIST), str(destination))
    os.rename(source, destination)


def _rename_away(image_dir: Path) -> Path:
    """Move the image out of its name at once (restores and listings no longer see it)."""
    staging = image_dir.parent / f".{image_dir.name}{RM_INFIX}{secrets.token_hex(4)}"
    try:
        _rename_noreplace(image_dir, staging)
    except OSError as exc:
        raise ImageError(f"cannot move {image_dir} aside to remove it: {exc.strerror}",
                         hint="nothing was deleted; check the filesystem and run vsnap rm again") from None
    fd = os.open(image_dir.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return staging


def _open_dir(parent_fd: int, name: str) -> int:
    return os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent_fd)


def _walk_to_parent(top: int, rel: str) -> tuple[int, str]:
    """An fd of the directory holding ``rel`` (walked from ``top`` without following links; the
    caller closes it) and ``rel``'s last component."""
    *parents, leaf = rel.split("/")
    fd = os.dup(top)
    try:
        for index, part in enumerate(parents):
            try:
                step = _open_dir(fd, part)
            except OSError as exc:
                if exc.errno not in (errno.ENOTDIR, errno.ELOOP):
                    raise
                raise ImageUntrusted("/".join(parents[:index + 1]), "is not a real directory any more (a link or "
                                     "a file); vsnap removes nothing through it",
                                     hint="look at what is left, and remove it yourself") from None
            os.close(fd)
            fd = step
    except BaseException:
        os.close(fd)
        raise
    return fd, leaf


def _delete(directory: Path, files: list[str], dirs: list[str]) -> None:
    """Unlink ``files`` (relative, in order) and then remove ``dirs`` (deepest first) and
    ``directory`` itself, every step relative to a directory fd opened without following links.
    What is already gone is skipped; anything else left makes rmdir fail, and is reported."""
    top = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        for rel in files:
            try:
                fd, leaf = _walk_to_parent(top, rel)
            except FileNotFoundError:
                continue
            try:
                if stat.S_ISREG(os.stat(leaf, dir_fd=fd, follow_symlinks=False).st_mode):
                    os.unlink(leaf, dir_fd=fd)
            except FileNotFoundError:
                pass
            finally:
                os.close(fd)
        for rel in dirs:
            try:
                fd, leaf = _walk_to_parent(top, rel)
            except FileNotFoundError:
                continue
            try:
                os.rmdir(leaf, dir_fd=fd)
            except FileNotFoundError:
                pass
            except OSError as exc:
                raise _left_behind(directory / rel, exc) from None
            finally:
                os.close(fd)
    finally:
        os.close(top)
    try:
        os.rmdir(directory)
    except OSError as exc:
        raise _left_behind(directory, exc) from None


def _left_behind(path: Path, exc: OSError) -> ImageError:
    why = "still holds entries vsnap did not make" if exc.errno in (errno.ENOTEMPTY, errno.EEXIST) else exc.strerror
    return ImageError(f"removed what vsnap made, but {path} {why}; left it there",
                      hint="look at it, and remove it yourself")


def finish_interrupted(image_dir: Path) -> tuple[list[str], list[ImageError]]:
    """Complete removals of ``image_dir`` that were interrupted: its `.NAME.rm-XXXXXXXX` siblings
    that are root's private directories. One that still has its manifest is removed as an image
    (what the manifest lists); one without is removed only if nothing but empty directories is
    left in it. Returns the paths finished, and why others were left (nothing of those is deleted)."""
    finished: list[str] = []
    problems: list[ImageError] = []
    pattern = re.compile(rf"^\.{re.escape(image_dir.name)}{re.escape(RM_INFIX)}[0-9a-f]{{8}}$")
    try:
        names = sorted(n for n in os.listdir(image_dir.parent) if pattern.match(n))
    except FileNotFoundError:
        return [], []
    for name in names:
        leftover = image_dir.parent / name
        try:
            st = os.lstat(leftover)
        except FileNotFoundError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            continue  # not what vsnap made (vsnap's are root's, 0700): not ours to delete
        try:
            files, dirs = _leftover_contents(leftover)
            _delete(leftover, files, dirs)
        except ImageError as exc:
            problems.append(exc)
            continue
        finished.append(str(leftover))
    return finished, problems


def _leftover_contents(leftover: Path) -> tuple[list[str], list[str]]:
    """What an interrupted removal left that vsnap recognizes: an image (its manifest is deleted
    last), or, once the manifest went, nothing but empty directories."""
    if _has_manifest(leftover):
        files, dirs, _ = recognize(leftover)
        return files, dirs
    dirs = []
    for dirpath, dirnames, filenames in os.walk(leftover, followlinks=False):
        links = [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]
        if filenames or links:
            raise ImageError(f"{leftover} holds files but no manifest; vsnap removes only what it recognizes",
                             hint="look at it, and remove it yourself")
        dirs += [str((Path(dirpath) / d).relative_to(leftover)) for d in dirnames]
    return [], sorted(dirs, key=lambda d: -d.count("/"))
