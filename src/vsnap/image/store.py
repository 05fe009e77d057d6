"""Image directories: private staging, checksums, publish by atomic rename, verification.

An image is published under its final name only when complete: it is written into a private
staging directory beside the final one, fsynced, then renamed (or exchanged with an older
image by renameat2(RENAME_EXCHANGE), so a good image is never lost to a failed capture).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import stat
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterable, Iterator

from vsnap.host import verified
from vsnap.host.fs import RENAME_EXCHANGE, renameat2
from vsnap.host.paths import require_safe_directory
from vsnap.host.trust import (
    is_private_dir,
    make_trusted_dirs,
    require_inside,
    require_plain_names,
    require_trusted_ancestors,
    require_trusted_tree,
)
from vsnap.protocol.errors import ImageBusy, ImageError, ImageTampered, ImageUntrusted

from .manifest import MANIFEST, PIECES_SCHEME, SHM_DIR, FileEntry, Manifest

CHUNK = 4 << 20
# Image files are hashed in pieces of this size, all pieces of all files in parallel: one big
# pages-*.img no longer bounds verification to one core's sha256 speed.
PIECE = 64 << 20
HASH_THREADS = min(16, os.cpu_count() or 2)


def sha256_file(path: Path, size: int | None = None) -> str:
    """sha256 of a regular file (opened without blocking, so a FIFO or device put in its place is
    refused rather than read forever), refused if it holds more than its size said when opened (a
    file that grows while hashed, or a pseudo file of size 0 whose reading never ends), or if that
    size is not ``size`` (the size recorded beside the digest)."""
    digest = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    with open(fd, "rb", buffering=0) as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ImageError(f"{path} is not a regular file; vsnap hashes only regular files")
        if size is not None and st.st_size != size:
            raise ImageError(f"{path} changed while vsnap read it ({st.st_size} bytes, {size} a moment before)",
                             hint="let whatever writes it finish, then try again")
        left = st.st_size
        while left > 0 and (chunk := f.read(min(CHUNK, left))):
            digest.update(chunk)
            left -= len(chunk)
        if f.read(1):
            raise ImageError(f"{path} grew while it was hashed (more than its {st.st_size} bytes)",
                             hint="let whatever writes it finish, then try again; a file whose size says 0 but "
                                  "that has bytes (a pseudo file) cannot be a dependency")
    return digest.hexdigest()


def _sha256_piece(path: Path, offset: int, length: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        f.seek(offset)
        left = length
        while left > 0 and (chunk := f.read(min(CHUNK, left))):
            digest.update(chunk)
            left -= len(chunk)
    return digest.hexdigest()


def piece_hashes(root: Path, files: dict[str, int]) -> dict[str, str]:
    """For each file (relative path -> size), sha256 over the sha256 of each PIECE-sized piece.

    A file of at most one piece gets its plain sha256 (so small files read as usual); pieces of all
    files are hashed in parallel (hashlib releases the GIL on large buffers).
    """
    jobs = [(rel, offset) for rel, size in files.items() for offset in range(0, max(size, 1), PIECE)]
    with ThreadPoolExecutor(max_workers=HASH_THREADS) as pool:
        digests = list(pool.map(lambda job: _sha256_piece(root / job[0], job[1], PIECE), jobs))
    pieces: dict[str, list[str]] = {rel: [] for rel in files}
    for (rel, _), digest in zip(jobs, digests):
        pieces[rel].append(digest)
    return {rel: parts[0] if len(parts) == 1 else hashlib.sha256("".join(parts).encode()).hexdigest()
            for rel, parts in pieces.items()}


def check_parent(image_dir: Path) -> None:
    """The image's parent and its ancestors must be root's and not writable by others: they could
    swap the image. Missing directories are made, private. None of them may be an image."""
    require_outside_images(image_dir, "the image", IMAGE_OUTSIDE_IMAGES)
    make_trusted_dirs(image_dir.parent)  # walked through directory fds: never made through someone's link
    require_trusted_ancestors(image_dir)


def require_replaceable(image_dir: Path, force: bool, elsewhere: str = "capture into another --image") -> None:
    """What may stand at ``image_dir`` before a capture or a pull: nothing, or (with --force) a
    vsnap image; ``elsewhere`` says how to choose another path (the command's option).

    Checked before the boot and again at publish: never a link, never a directory without a
    vsnap manifest (a capture with --force must not delete an ordinary directory)."""
    try:
        st = os.lstat(image_dir)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):
        raise ImageUntrusted(image_dir, "is a symlink; vsnap never replaces or follows one",
                             hint=f"remove the link, or {elsewhere}")
    if not stat.S_ISDIR(st.st_mode):
        raise ImageError(f"{image_dir} exists and is not a directory; refusing to replace it",
                         hint=f"remove it, or {elsewhere}")
    if not is_vsnap_image(image_dir):  # before --force is mentioned: it would not replace this either
        raise ImageError(f"{image_dir} is not a vsnap image (no vsnap manifest.json); --force replaces only images",
                         hint=f"remove it yourself if it is yours to delete, or {elsewhere}")
    if not force:
        raise ImageError(f"{image_dir} already exists", hint="pass --force to replace it once the new one is complete")
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:  # vsnap's images are root's, 0700
        raise ImageUntrusted(image_dir, f"is owned by uid {st.st_uid} (mode {stat.S_IMODE(st.st_mode):04o}); "
                                        "--force replaces only root's own images",
                             hint=f"remove it yourself if it is yours to delete, or {elsewhere}")


def is_vsnap_image(directory: Path) -> bool:
    """A directory holding a regular manifest.json that reads as some version of vsnap's manifest."""
    try:
        # O_NONBLOCK: a FIFO named manifest.json must be refused, not waited on
        fd = os.open(directory / MANIFEST, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > 16 << 20:
            return False
        raw = json.loads(os.read(fd, st.st_size + 1) or b"null")
    except (OSError, ValueError, RecursionError):  # RecursionError: JSON nested too deep
        return False
    finally:
        os.close(fd)
    return isinstance(raw, dict) and isinstance(raw.get("format_version"), int) and isinstance(raw.get("files"), dict)


IMAGE_OUTSIDE_IMAGES = "choose an image path (model.yaml's image, or --to) outside every image"
CONTROL_OUTSIDE_IMAGES = "choose a snapshot.control_dir outside every image"
# what a capture stages an image in beside it (make_staging's mkdtemp), and what its publish moves the old one to
_STAGING_SUFFIX = r"\.staging-[a-z0-9_]{8}|\.old-[0-9]+"
# every directory vsnap stages an image in, beside it: those, a pull's and an interrupted rm's
_IMAGE_WORK_DIR = re.compile(rf"\..+(?:{_STAGING_SUFFIX}|\.pull-[0-9a-f]{{16}}|\.rm-[0-9a-f]{{8}})", re.DOTALL)


def require_outside_images(path: Path, what: str, hint: str, *, itself: bool = False) -> None:
    """No directory above ``path`` (nor ``path`` itself, with ``itself``) is a vsnap image or a
    directory vsnap stages one in: a capture or a pull there would write its files into that image,
    which then no longer matches its manifest (refused at every restore, by vsnap rm too)."""
    for above in ([path] if itself else []) + list(path.parents):
        if is_vsnap_image(above) or _IMAGE_WORK_DIR.fullmatch(above.name):
            raise ImageError(f"{what} {path} is inside the vsnap image {above}; writing there would change "
                             "that image", hint=hint)


RECORDED_CONTROL_HINT = ("capture the image again with a snapshot.control_dir outside every image, or move the "
                         "image that holds its control directory")


def require_recorded_control_dir(control_dir: str) -> None:
    """What a restore (and `vsnap validate IMAGE`) requires of the control directory an image
    records, before anything is read or made: a plain absolute path, no system directory, root's
    ancestors, and inside no image."""
    require_safe_directory(control_dir, "the manifest's control_dir")
    require_trusted_ancestors(Path(control_dir))
    require_outside_images(Path(control_dir), "the control directory", RECORDED_CONTROL_HINT, itself=True)


def _open_lock(lock_path: Path) -> int:
    """Open (creating) a lock file beside an image, never through a link; it must be root's."""
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ImageUntrusted(lock_path, "is a symlink; vsnap never follows a link at its lock",
                                 hint=f"remove {lock_path} (vsnap makes it again)") from None
        raise ImageError(f"cannot open the lock {lock_path}: {exc.strerror}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        os.close(fd)
        raise ImageUntrusted(lock_path, "is not a private regular file of root's; it cannot serve as a lock",
                             hint=f"remove {lock_path} (vsnap makes it again)")
    return fd


def _flock(fd: int, operation: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fcntl.flock(fd, operation | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)


@contextmanager
def held_lock(lock_path: Path, operation: int, timeout_s: float, busy: Callable[[], Exception]) -> Iterator[None]:
    """A flock (``operation``) on ``lock_path`` (opened by _open_lock: never through a link, root's
    private file) for the block; ``busy()`` is raised when it cannot be had within ``timeout_s``."""
    fd = _open_lock(lock_path)
    try:
        if not _flock(fd, operation, timeout_s):
            raise busy()
        yield
    finally:
        os.close(fd)


def capture_lock_path(image_dir: Path) -> Path:
    """`.NAME.lock` beside the image: held by a capture (or pull) writing it, and by `vsnap rm`."""
    return image_dir.parent / f".{image_dir.name}.lock"


def readers_lock_path(image_dir: Path) -> Path:
    """`.NAME.readers.lock` beside the image: shared by restores reading it, exclusive to replace it."""
    return image_dir.parent / f".{image_dir.name}.readers.lock"


@contextmanager
def image_lock(image_dir: Path) -> Iterator[None]:
    """One capture per image path at a time (a flock on `.NAME.lock` beside it)."""
    lock_path = capture_lock_path(image_dir)
    with held_lock(lock_path, fcntl.LOCK_EX, 0, lambda: ImageBusy(
            lock_path, f"another vsnap capture is writing {image_dir}",
            hint="wait for it to finish, or capture into another --image")):
        yield


# Restores hold this shared from verification until the engine has read the image's weights;
# a capture's publish takes it exclusively, so an image never changes under a restore.
READ_LOCK_WAIT_S = 120.0


@contextmanager
def image_read_lock(image_dir: Path, *, exclusive: bool = False, timeout_s: float = READ_LOCK_WAIT_S) -> Iterator[None]:
    lock_path = readers_lock_path(image_dir)
    doing = "restores are still reading" if exclusive else "a capture is replacing"
    with held_lock(lock_path, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH, timeout_s,
                   lambda: ImageBusy(lock_path, f"{doing} {image_dir} (waited {timeout_s:g} s)")):
        yield


def make_staging(image_dir: Path) -> Path:
    return Path(tempfile.mkdtemp(prefix=f".{image_dir.name}.staging-", dir=image_dir.parent))


def leftovers(image_dir: Path, suffix: str) -> list[Path]:
    """The entries beside ``image_dir`` named ``.NAME`` + a match of the regex ``suffix``: NAME
    matched literally (never as a glob: an image named `a*` or `[ab]` must not select the staging
    directories of images `ab` or `a` being captured or pulled meanwhile)."""
    pattern = re.compile(rf"\.{re.escape(image_dir.name)}(?:{suffix})", re.DOTALL)
    try:
        names = os.listdir(image_dir.parent)
    except FileNotFoundError:
        return []
    return [image_dir.parent / name for name in sorted(names) if pattern.fullmatch(name)]


def remove_stale_staging(image_dir: Path) -> None:
    """Drop staging directories that an interrupted capture of this image left (we hold the lock).

    Only what vsnap makes: real directories, root's, private (mkdtemp's 0700). In a sticky parent
    such as /tmp another user can create `.NAME.staging-x` too, and that is not ours to delete."""
    for leftover in leftovers(image_dir, _STAGING_SUFFIX):
        try:
            st = os.lstat(leftover)
        except FileNotFoundError:
            continue
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o077:
            shutil.rmtree(leftover, ignore_errors=True)


def make_or_adopt_staging_dir(staging: Path, others: Iterable[Path], what: str, hint: str) -> Path:
    """A pull's staging directory: made private (0700), or the one an interrupted pull of the same
    manifest left, if vsnap made it (is_private_dir); ``others`` (other pulls' leftovers of the kind)
    removed when vsnap made them. Anything else at ``staging``: ImageUntrusted ("stands where vsnap
    stages ``what``"), never adopted or removed."""
    for other in others:
        if other != staging and is_private_dir(other):
            shutil.rmtree(other, ignore_errors=True)
            verified.forget(other)
    try:
        os.mkdir(staging, 0o700)
    except FileExistsError:
        if not is_private_dir(staging):
            raise ImageUntrusted(staging, f"stands where vsnap stages {what} and is not a private directory of "
                                          "root's that vsnap made", hint=hint) from None
    return staging


def checksum_tree(root: Path, skip: tuple[str, ...] = (MANIFEST,)) -> dict[str, FileEntry]:
    """Size and piece hash (see piece_hashes) of every file under ``root``."""
    sizes = {str(p.relative_to(root)): p.stat().st_size for p in sorted(root.rglob("*"))
             if p.is_file() and str(p.relative_to(root)) not in skip}
    digests = piece_hashes(root, sizes)
    return {rel: FileEntry(size=size, digest=digests[rel], scheme=digest_scheme(size)) for rel, size in sizes.items()}


def digest_scheme(size: int) -> str:
    """How piece_hashes digests a file of this size (see FileEntry)."""
    return "sha256" if size <= PIECE else PIECES_SCHEME


def fsync_tree(root: Path) -> None:
    """fsync every file and directory, making them private (files 0600, directories 0700) on the way."""
    for dirpath, _, filenames in os.walk(root):
        os.chmod(dirpath, 0o700)
        for name in filenames:
            os.chmod(os.path.join(dirpath, name), 0o600)
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fd = os.open(dirpath, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def publish(staging: Path, image_dir: Path) -> None:
    """Make ``staging`` visible as ``image_dir`` in one rename; an older image is swapped out, then removed."""
    fsync_tree(staging)
    if os.path.lexists(image_dir):
        require_replaceable(image_dir, force=True)
        try:
            renameat2(staging, image_dir, RENAME_EXCHANGE)
        except OSError:  # no renameat2, or a filesystem without the exchange: the old image goes aside first
            old = image_dir.parent / f".{image_dir.name}.old-{os.getpid()}"
            os.rename(image_dir, old)
            os.rename(staging, image_dir)
            staging = old
        shutil.rmtree(staging, ignore_errors=True)
    else:
        os.rename(staging, image_dir)
    fd = os.open(image_dir.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def require_trust(image_dir: Path, manifest: Manifest) -> None:
    """The paths a manifest names stay inside the image; the names it asks vsnap to create
    elsewhere are plain file names (see host.trust). Raises ImageUntrusted."""
    for rel in manifest.files:
        require_inside(rel, "manifest 'files'")
    require_plain_names(manifest.shm_files, "manifest 'shm_files'")
    for name in manifest.shm_files:
        if f"{SHM_DIR}/{name}" not in manifest.files:
            raise ImageUntrusted(name, "manifest 'shm_files' names a file the image does not list",
                                 hint="the manifest was altered; capture the image again")


def verify_files(image_dir: Path, manifest: Manifest, *, cache_root: Path | None = None,
                 rehash: bool = False) -> list[str]:
    """Every file the manifest lists is a regular file of the recorded size and sha256; no others exist.

    With ``cache_root``, files this host already hashed and that did not change since (see
    host.verified) are not hashed again unless ``rehash``, and the ones hashed now are remembered
    there. Returns the files that were hashed.
    """
    require_trust(image_dir, manifest)
    listed = set(manifest.files)
    for rel in sorted(require_trusted_tree(image_dir)):
        if rel != MANIFEST and rel not in listed:
            raise ImageTampered(rel, "no such file", "an unlisted file")
    known = verified.load(image_dir, cache_root) if cache_root is not None and not rehash else {}
    to_hash: dict[str, int] = {}
    stats: dict[str, os.stat_result] = {}
    statted_at = time.time_ns()
    for rel, entry in manifest.files.items():
        path = image_dir / rel
        try:
            st = os.lstat(path)
        except (OSError, ValueError):  # absent, or a name no file can have (too long)
            raise ImageTampered(rel[:200], f"{entry.size} bytes", "missing") from None
        if not stat.S_ISREG(st.st_mode):
            raise ImageTampered(rel, "a regular file", "something else")
        if st.st_size != entry.size:
            raise ImageTampered(rel, f"{entry.size} bytes", f"{st.st_size} bytes")
        stats[rel] = st
        if entry.scheme != digest_scheme(entry.size):
            raise ImageTampered(rel, f"digest scheme {digest_scheme(entry.size)}", f"scheme {entry.scheme}")
        if not verified.still_verified(known, rel, st, entry.digest):
            to_hash[rel] = entry.size
    digests = piece_hashes(image_dir, to_hash)
    for rel, digest in sorted(digests.items()):
        if digest != manifest.files[rel].digest:
            verified.forget(image_dir, cache_root or verified.VERIFIED_DIR)
            raise ImageTampered(rel, f"digest {manifest.files[rel].digest[:16]}…", f"digest {digest[:16]}…")
    if cache_root is not None and digests:
        verified.remember(image_dir, {rel: (stats[rel], entry.digest) for rel, entry in manifest.files.items()},
                          cache_root, statted_at)
    return sorted(digests)
