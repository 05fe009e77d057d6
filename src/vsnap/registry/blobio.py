"""Bytes into and out of blobs: zstd while streaming, and the digests a pull checks as it writes.

A push compresses a file as it sends it (nothing is spooled to disk) and learns the blob's
digest at its end. A pull writes a blob into its file as it arrives, checking on the way the
blob's sha256 (what the registry promised), the file's digest by the manifest's scheme (what the
capture recorded) and both sizes; a zstd stream that would decompress past the file's recorded
size is cut off there (no decompression bomb), and runs of zeros become holes (vLLM's shared-memory
rings are 400 MB files of which a few KB are written).
"""

from __future__ import annotations

import hashlib
import io
import os
import threading
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, TypeVar

from vsnap.image.manifest import FileEntry
from vsnap.image.store import PIECE
from vsnap.protocol.errors import ArtifactError, HostNotReady

from .oci import Layer

# A blob's file is written CHUNK bytes at a time at offsets that are multiples of it (a registry's
# body comes in 256 KiB pieces): the page cache then holds the file in 2 MiB folios, which a restore
# that reads the model's files by reference page-locks 1.8x faster than what small writes leave
# (docs/benchmarks/folio-probe-h100-2026-12-05.md)
CHUNK = 4 << 20
ZSTD_LEVEL = 3  # zstd's default: docs/benchmarks/NOTES.md has the ratio and speed of levels 1, 3 and 6 on CRIU pages
_ZEROS = bytes(CHUNK)
T = TypeVar("T")
R = TypeVar("R")


def _zstandard():  # type: ignore[no-untyped-def]
    try:
        import zstandard
    except ImportError:
        raise HostNotReady("zstandard", "vsnap push and pull need the zstandard package",
                           hint="pip install 'vsnap[registry]'") from None
    return zstandard


class FileDigest:
    """``image.store.piece_hashes`` of one file, fed in order: the sha256 of a file of at most one
    PIECE, else the sha256 of its pieces' hex sha256, concatenated."""

    def __init__(self) -> None:
        self._pieces: list[str] = []
        self._piece = hashlib.sha256()
        self._in_piece = 0
        self.size = 0

    def update(self, data: bytes | memoryview) -> None:
        view = memoryview(data)
        while view:
            take = min(len(view), PIECE - self._in_piece)
            self._piece.update(view[:take])
            self._in_piece += take
            self.size += take
            view = view[take:]
            if self._in_piece == PIECE:
                self._pieces.append(self._piece.hexdigest())
                self._piece, self._in_piece = hashlib.sha256(), 0

    def piece_digests(self) -> list[str]:
        """The hex sha256 of each piece fed so far (the last may be short; none fed: the empty one)."""
        return self._pieces + ([self._piece.hexdigest()] if self._in_piece or not self._pieces else [])

    def hexdigest(self) -> str:
        return combine_pieces(self.piece_digests())


def combine_pieces(pieces: list[str]) -> str:
    """A file's digest from its pieces' hex sha256, in order (``image.store.piece_hashes``)."""
    return pieces[0] if len(pieces) == 1 else hashlib.sha256("".join(pieces).encode()).hexdigest()


class HashingIterator:
    """The chunks of ``source``, hashed (sha256) and counted as they pass: a streamed upload
    learns its blob's digest at its end."""

    def __init__(self, source: Iterable[bytes], on_bytes: Callable[[int], None] | None = None, *,
                 digest: str | None = None) -> None:
        self._source = source
        self._sha = hashlib.sha256()
        self._on_bytes = on_bytes
        self._known = digest  # a raw file whose digest was computed before: not hashed again
        self.size = 0

    def __iter__(self) -> Iterator[bytes]:
        for chunk in self._source:
            if chunk:
                if self._known is None:
                    self._sha.update(chunk)
                self.size += len(chunk)
                if self._on_bytes:
                    self._on_bytes(len(chunk))
                yield chunk

    @property
    def digest(self) -> str:
        return self._known or "sha256:" + self._sha.hexdigest()


def zstd_chunks(path: Path, level: int = ZSTD_LEVEL, threads: int = 1) -> Iterator[bytes]:
    """``path`` compressed as one zstd frame, in chunks (the file opened without following links).
    ``threads`` >= 1: zstd's multi-threaded mode, whose output does not depend on the count."""
    zstd = _zstandard()
    compressor = zstd.ZstdCompressor(level=level, threads=threads)
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    with open(fd, "rb", buffering=0) as f:  # the frame header records the size (`zstd -l` shows it)
        yield from compressor.read_to_iter(f, size=os.fstat(fd).st_size, read_size=CHUNK, write_size=CHUNK)


def file_chunks(path: Path, opener: Callable[[Path], int] | None = None) -> Iterator[bytes]:
    """The bytes of ``path``, in chunks: opened (once iterated) by ``opener``, by default without
    following a link."""
    fd = opener(path) if opener is not None else os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    with open(fd, "rb", buffering=0) as f:
        while chunk := f.read(CHUNK):
            yield chunk


class _CountingSource(io.RawIOBase):
    """A readable stream over the chunks a registry sends: hashed, counted, and refused once it
    runs past the layer's size."""

    def __init__(self, chunks: Iterable[bytes], limit: int, too_long: Callable[[], Exception],
                 on_bytes: Callable[[int], None] | None) -> None:
        self._chunks = iter(chunks)
        self._view = memoryview(b"")
        self._limit, self._too_long, self._on_bytes = limit, too_long, on_bytes
        self.sha = hashlib.sha256()
        self.size = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        while not self._view:
            chunk = next(self._chunks, None)
            if chunk is None:
                return 0
            self.size += len(chunk)
            if self.size > self._limit:
                raise self._too_long()
            self.sha.update(chunk)
            if self._on_bytes:
                self._on_bytes(len(chunk))
            self._view = memoryview(chunk)
        n = min(len(buffer), len(self._view))
        buffer[:n] = self._view[:n]
        self._view = self._view[n:]
        return n


def write_blob(chunks: Iterable[bytes], layer: Layer, entry: FileEntry, fd: int, reference: str,
               on_bytes: Callable[[int], None] | None = None) -> None:
    """Write the blob ``chunks`` (decompressing a zstd layer) into ``fd`` and check, before the
    caller renames the file into place: the blob's size and sha256 against the layer, the file's
    size and digest against manifest.json. ArtifactError names the file."""
    path = layer.path

    def mismatch(what: str) -> ArtifactError:
        return ArtifactError(reference, f"{reference}: the blob for {path} {what}", file=path,
                             hint="the registry's copy was altered or damaged; push the image again")

    source = _CountingSource(chunks, layer.size, lambda: mismatch(f"runs past its {layer.size} bytes"), on_bytes)
    reader: io.RawIOBase
    if layer.encoding == "zstd":
        zstd = _zstandard()
        reader = zstd.ZstdDecompressor().stream_reader(source, read_size=CHUNK, read_across_frames=True)
    else:
        reader = source
    # the file's digest by its entry's scheme: a whole-file sha256 (any size for a model file, at
    # most a piece for an image file), else the pieces'. A raw layer's blob sha256 is a whole-file
    # sha256 already: its bytes are hashed once, not twice
    blob_is_file = layer.encoding == "raw" and entry.scheme == "sha256"
    digest: Any = FileDigest() if entry.scheme != "sha256" else None if blob_is_file else hashlib.sha256()
    size = 0
    buffer = memoryview(bytearray(CHUNK))
    try:
        while got := _fill(reader, buffer):
            data = buffer[:got]
            if size + len(data) > entry.size:
                raise mismatch(f"holds more than the {entry.size} bytes manifest.json records")
            size += len(data)
            if digest is not None:
                digest.update(data)
            # a CHUNK of zeros is a hole (sparse files stay sparse); startswith compares with memcmp,
            # where memoryview == bytes goes element by element, 50x slower
            if len(data) == CHUNK and not data[0] and not data[-1] and _ZEROS.startswith(data):
                os.lseek(fd, len(data), os.SEEK_CUR)
            else:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
        while source.read(CHUNK):  # a zstd frame may end before the blob does: every byte counts
            pass
    except (ArtifactError, Cancelled):
        raise
    except Exception as exc:  # zstandard.ZstdError: say first whether the bytes are the pushed ones
        if not type(exc).__module__.startswith("zstandard"):
            raise
        while source.read(CHUNK):
            pass
        _require_blob(source, layer, mismatch)
        raise mismatch(f"is not a valid zstd stream ({exc})") from None
    os.ftruncate(fd, size)
    _require_blob(source, layer, mismatch)
    if size != entry.size:
        raise mismatch(f"holds {size} bytes; manifest.json records {entry.size}")
    found = source.sha.hexdigest() if digest is None else digest.hexdigest()
    if found != entry.digest:
        raise mismatch(f"does not match manifest.json (expected {entry.digest[:16]}…, found {found[:16]}…)")


def _fill(reader: Any, buffer: memoryview) -> int:
    """Read into ``buffer`` until it is full or the stream ends; the bytes read."""
    got = 0
    while got < len(buffer) and (n := reader.readinto(buffer[got:])):
        got += n
    return got


def _require_blob(source: _CountingSource, layer: Layer, mismatch: Callable[[str], ArtifactError]) -> None:
    blob_digest = "sha256:" + source.sha.hexdigest()
    if source.size != layer.size:
        raise mismatch(f"has {source.size} bytes; the artifact promised {layer.size}")
    if blob_digest != layer.digest:
        raise mismatch(f"does not match its digest (expected {layer.digest[:19]}…, received {blob_digest[:19]}…)")


class Cancelled(Exception):
    """Raised inside a transfer once another transfer of the same push or pull failed (or Ctrl-C
    came): it stops at its next chunk instead of moving gigabytes for nothing."""


def parallel(fn: Callable[[T], R], items: Iterable[T], jobs: int, cancel: threading.Event) -> list[R]:
    """``fn`` over ``items`` on ``jobs`` threads; the first failure sets ``cancel`` (which the
    transfers check between chunks), drops what has not started, and is raised."""
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures = [pool.submit(fn, item) for item in items]
        try:
            for future in as_completed(futures):
                future.result()
        except BaseException:
            cancel.set()
            for future in futures:
                future.cancel()
            raise
    return [future.result() for future in futures]


def checking(cancel: threading.Event, then: Callable[[int], None] | None = None) -> Callable[[int], None]:
    """A byte counter callback that raises Cancelled once ``cancel`` is set."""
    def on_bytes(nbytes: int) -> None:
        if cancel.is_set():
            raise Cancelled()
        if then is not None:
            then(nbytes)
    return on_bytes
