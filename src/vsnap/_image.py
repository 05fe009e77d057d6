"""Image directories: private staging, checksums, publish by atomic rename, verification.

An image is published under its final name only when complete: it is written into a private
staging directory beside the final one, fsynced, then renamed (or exchanged with an older
image by renameat2(RENAME_EXCHANGE), so a good image is never lost to a failed capture).
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import os
import shutil
import stat
import tempfile
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from . import _verified as verified
from .protocol.errors import ImageError, ImageTampered
from ._manifest import MANIFEST, FileEntry, Manifest

RENAME_EXCHANGE = 2
CHUNK = 4 << 20
# Image files are hashed in pieces of this size, all pieces of all files in parallel: one big
# pages-*.img no longer bounds verification to one core's sha256 speed.
PIECE = 64 << 20
HASH_THREADS = min(16, os.cpu_count() or 2)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
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
    """The image's parent must not be writable by others: they could swap the image."""
    parent = image_dir.parent
    parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = parent.stat()
    if st.st_mode & 0o022:
        raise ImageError(f"{parent} is writable by group or others; an image there could be replaced",
                         hint=f"chmod go-w {parent}, or choose another image directory")


@contextmanager
def image_lock(image_dir: Path) -> Iterator[None]:
    """One capture per image path at a time (a flock on a file beside it)."""
    lock_path = image_dir.parent / f".{image_dir.name}.lock"
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ImageError(f"another vsnap capture is writing {image_dir}",
                             hint="wait for it to finish, or capture into another --image") from None
        yield
    finally:
        os.close(fd)


def make_staging(image_dir: Path) -> Path:
    return Path(tempfile.mkdtemp(prefix=f".{image_dir.name}.staging-", dir=image_dir.parent))


def remove_stale_staging(image_dir: Path) -> None:
    """Drop staging directories that an interrupted capture of this image left (we hold the lock)."""
    for leftover in image_dir.parent.glob(f".{image_dir.name}.staging-*"):
        shutil.rmtree(leftover, ignore_errors=True)
    for leftover in image_dir.parent.glob(f".{image_dir.name}.old-*"):
        shutil.rmtree(leftover, ignore_errors=True)


def checksum_tree(root: Path, skip: tuple[str, ...] = (MANIFEST,)) -> dict[str, FileEntry]:
    """Size and piece hash (see piece_hashes) of every file under ``root``."""
    sizes = {str(p.relative_to(root)): p.stat().st_size for p in sorted(root.rglob("*"))
             if p.is_file() and str(p.relative_to(root)) not in skip}
    digests = piece_hashes(root, sizes)
    return {rel: FileEntry(size=size, sha256=digests[rel]) for rel, size in sizes.items()}


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


def _rename_exchange(a: Path, b: Path) -> bool:
    libc = ctypes.CDLL(None, use_errno=True)
    if not hasattr(libc, "renameat2"):
        return False
    at_fdcwd = -100
    return libc.renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), RENAME_EXCHANGE) == 0


def publish(staging: Path, image_dir: Path) -> None:
    """Make ``staging`` visible as ``image_dir`` in one rename; an older image is swapped out, then removed."""
    fsync_tree(staging)
    if image_dir.exists() or image_dir.is_symlink():
        if image_dir.is_symlink() or not image_dir.is_dir():
            raise ImageError(f"{image_dir} exists and is not an image directory; refusing to replace it")
        if not _rename_exchange(staging, image_dir):
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


def verify_files(image_dir: Path, manifest: Manifest, *, cache_root: Path | None = None,
                 rehash: bool = False) -> list[str]:
    """Every file the manifest lists is a regular file of the recorded size and sha256; no others exist.

    With ``cache_root``, files this host already hashed and that did not change since (see
    _verified) are not hashed again unless ``rehash``, and the ones hashed now are remembered
    there. Returns the files that were hashed.
    """
    listed = set(manifest.files)
    for path in sorted(image_dir.rglob("*")):
        rel = str(path.relative_to(image_dir))
        if path.is_symlink():
            raise ImageTampered(rel, "a regular file", "a symlink")
        if path.is_file() and rel != MANIFEST and rel not in listed:
            raise ImageTampered(rel, "no such file", "an unlisted file")
    known = verified.load(image_dir, cache_root) if cache_root is not None and not rehash else {}
    to_hash: dict[str, int] = {}
    stats: dict[str, os.stat_result] = {}
    for rel, entry in manifest.files.items():
        path = image_dir / rel
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            raise ImageTampered(rel, f"{entry.size} bytes", "missing") from None
        if not stat.S_ISREG(st.st_mode):
            raise ImageTampered(rel, "a regular file", "something else")
        if st.st_size != entry.size:
            raise ImageTampered(rel, f"{entry.size} bytes", f"{st.st_size} bytes")
        stats[rel] = st
        if not verified.still_verified(known, rel, st, entry.sha256):
            to_hash[rel] = entry.size
    digests = piece_hashes(image_dir, to_hash)
    for rel, digest in sorted(digests.items()):
        if digest != manifest.files[rel].sha256:
            verified.forget(image_dir, cache_root or verified.VERIFIED_DIR)
            raise ImageTampered(rel, f"sha256 {manifest.files[rel].sha256[:16]}…", f"sha256 {digest[:16]}…")
    if cache_root is not None and digests:
        verified.remember(image_dir, {rel: (stats[rel], entry.sha256) for rel, entry in manifest.files.items()},
                          cache_root)
    return sorted(digests)
