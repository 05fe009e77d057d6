"""A large raw layer fetched as byte ranges in parallel, each part written at its offset and
hashed by the manifest's pieces as it arrives.

Why: the weights file is one raw blob of many GB; fetched by one stream and hashed on one thread,
one connection and one core bound the pull (docs/benchmarks/NOTES.md, "Push and pull through a
registry"). Its manifest.json entry (scheme ``sha256-of-64MiB-pieces``: the sha256 over the hex
sha256 of each 64 MiB piece) comes from the config blob whose digest the OCI manifest pins, so its
pieces, hashed by the parts side by side, bind the file's bytes without one sequential sha256 over
the whole blob: the blob's own digest only names where the bytes are fetched from.

``plan``: the raw layer of a file hashed by pieces and over RANGED_MIN_BYTES is split into at most
``parts`` parts of whole pieces (only the last piece may be short), each fetched by one ``GET``
with ``Range: bytes=a-b`` on a connection and a thread of its own, into one file preallocated at
its size in the pull's ``.incoming/`` (``preallocate``), each byte written with pwrite at its
offset (chunks of zeros are not written: preallocated blocks read as zeros).

What the registry answers is checked before a byte is written:

- the first part is asked alone: a 200 means the registry ignores Range, and that answer (the
  whole blob) is read as one stream, as every pull did before (blobio.write_blob: the blob's size
  and sha256 too). Only a 206 starts the other parts.
- a 206 must carry ``Content-Range: bytes a-b/SIZE`` for exactly the range asked (SIZE the
  layer's, or ``*``), no Content-Encoding, and a Content-Length (if any) of b-a+1; its body is cut
  off at b-a+1 bytes (nothing is written past the part) and must reach it. A 200 to a later part
  (the first was a 206) is refused too. Each refusal is RegistryUnavailable (exit 3) naming the
  file, the range and what came, in one line.
- the pieces of all the parts, in order, must hash to manifest.json's digest, else ArtifactError
  (exit 4) naming the file.

Each part has its own deadline (transport.Transfer), logins, redirects (followed with the Range
header; credentials only to the registry's origin) and retries (client). The first part to fail
sets the pull's cancel event, which every part, and every other file of the pull, checks at each
chunk; its error is raised once the other parts have stopped. The file is checked, renamed into
place and recorded (host.verified) as one, by the caller, never per part; a pull interrupted in the
middle of it fetches it again whole (files already renamed into place are kept, as before).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import re
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

from vsnap.image.manifest import PIECES_SCHEME, FileEntry
from vsnap.image.store import PIECE
from vsnap.protocol.errors import ArtifactError, RegistryUnavailable, UsageError

from .blobio import Cancelled, FileDigest, combine_pieces, write_blob
from .client import RegistryClient, range_what
from .oci import Layer

PARTS_ENV = "VSNAP_PULL_PARTS"
DEFAULT_PARTS = 4             # docs/benchmarks/pull-ranged-2026-12-04.md
MAX_PARTS = 64
RANGED_MIN_BYTES = 2 * PIECE + 1  # more than two pieces: smaller files go in one stream
READ_BYTES = 1 << 20          # one part's reads (transport.body's pieces)
# A part's bytes go to the file in pwrites of WRITE_BYTES at offsets that are multiples of it (parts
# start at 64 MiB pieces, and a registry's body comes in whole 1 MiB reads; odd-sized pieces keep
# the writes whole but not aligned). At 2 MiB or more the page cache holds the pulled file in 2 MiB
# folios, which the kernel maps with one page-table entry each, and page-locking them at restore
# (weights by reference lock the model's files) has no per-4-KiB-page work left. On the H100
# machine (8 GiB written both ways, then dma_into: docs/benchmarks/folio-probe-h100-2026-12-05.md)
# the file written in 1 MiB pwrites reached the GPU at 17.3 GB/s, the one written in 4 MiB pieces
# at 31.0 GB/s, and its writing cost 3.1 s instead of 2.6 s: the pull pays once what every restore
# from the cached pages gains. The reads stay 1 MiB: a cancelled pull is noticed between two reads.
WRITE_BYTES = 4 << 20
_MAX_IOV = 64  # chunks in one pwritev, far below IOV_MAX (1024) however small a registry's pieces
_ZEROS = bytes(READ_BYTES)  # what a read of zeros looks like
RANGE_HINT = (f"the registry (or a proxy before it) does not answer byte ranges as HTTP says; {PARTS_ENV}=1 "
              "fetches every blob in one stream")
_CONTENT_RANGE = re.compile(r"bytes ([0-9]{1,16})-([0-9]{1,16})/([0-9]{1,16}|\*)")


@dataclass(frozen=True)
class Part:
    """Bytes ``start`` to ``end`` (inclusive, as a Range header writes them) of one file."""

    start: int
    end: int

    @property
    def length(self) -> int:
        return self.end - self.start + 1


def parts_wanted(parts: int | None = None) -> int:
    """How many parts a large layer is fetched in: ``parts`` if given, else ``VSNAP_PULL_PARTS``,
    else DEFAULT_PARTS; 1 fetches every blob in one stream. UsageError outside 1..MAX_PARTS."""
    text = str(parts) if parts is not None else os.environ.get(PARTS_ENV, "").strip()
    if not text:
        return DEFAULT_PARTS
    if not text.isdigit() or not 1 <= int(text) <= MAX_PARTS:
        where = "the number of parts" if parts is not None else PARTS_ENV
        raise UsageError(f"{where} is {text[:20]!r}; it is a whole number from 1 to {MAX_PARTS}",
                         hint=f"1 fetches every blob in one stream; the default is {DEFAULT_PARTS}")
    return int(text)


def plan(layer: Layer, entry: FileEntry, parts: int) -> list[Part]:
    """The parts ``layer`` is fetched in, each a whole number of pieces (the last may end short);
    [] when it goes in one stream: compressed, hashed as one sha256, at most RANGED_MIN_BYTES, or
    ``parts`` < 2."""
    if parts < 2 or layer.encoding != "raw" or entry.scheme != PIECES_SCHEME or entry.size < RANGED_MIN_BYTES:
        return []
    pieces = -(-entry.size // PIECE)
    count = min(parts, pieces)
    bounds = [k * pieces // count * PIECE for k in range(count)] + [entry.size]
    return [Part(start, stop - 1) for start, stop in zip(bounds, bounds[1:])]


def fetch(clients: Callable[[], RegistryClient], layer: Layer, entry: FileEntry, fd: int, reference: str,
          parts: list[Part], on_bytes: Callable[[int], None], cancel: threading.Event) -> bool:
    """Fetch ``layer`` into ``fd`` (a new empty file) in ``parts`` (``plan``); ``clients`` gives
    each thread its own client. True if it came in ranges, False if the registry ignored Range (one
    stream). Raises as blobio.write_blob does, RegistryUnavailable for a range answered wrongly,
    Cancelled once ``cancel`` is set; sets ``cancel`` itself when a part fails."""
    first = parts[0]
    client = clients()
    pool = ThreadPoolExecutor(max_workers=len(parts) - 1, thread_name_prefix="vsnap-part")
    futures: list[Future[list[str]]] = []
    pieces: list[list[str]] = []
    first_error: BaseException | None = None
    try:
        with client.blob_range(layer.digest, first.start, first.end) as response:
            if response.status_code == 200:  # Range ignored: the whole blob, read as one stream
                what = range_what(layer.digest, first.start, first.end)
                write_blob(client.body(response, what), layer, entry, fd, reference, on_bytes)
                return False
            _check_answer(client, response, layer, entry.size, first)  # before any other part is asked
            preallocate(fd, entry.size)
            futures = [pool.submit(_other_part, clients, layer, entry.size, fd, part, on_bytes, cancel)
                       for part in parts[1:]]
            pieces.append(_write_part(client, response, layer, fd, first, on_bytes))
    except BaseException as exc:
        cancel.set()
        first_error = exc
    finally:
        pool.shutdown(wait=True)
    errors = ([first_error] if first_error else []) + [e for f in futures if (e := f.exception()) is not None]
    if errors:  # the cause, not the parts it cancelled
        raise next((e for e in errors if not isinstance(e, Cancelled)), errors[0])
    for future in futures:
        pieces.append(future.result())
    found = combine_pieces([digest for part in pieces for digest in part])
    if found != entry.digest:
        raise ArtifactError(reference, f"{reference}: the blob for {layer.path} does not match manifest.json "
                                       f"(expected {entry.digest[:16]}…, found {found[:16]}…; fetched in "
                                       f"{len(parts)} byte ranges)", file=layer.path,
                            hint="the registry's copy was altered or damaged; push the image again")
    return True


def _other_part(clients: Callable[[], RegistryClient], layer: Layer, size: int, fd: int, part: Part,
                on_bytes: Callable[[int], None], cancel: threading.Event) -> list[str]:
    try:
        if cancel.is_set():
            raise Cancelled()
        client = clients()
        with client.blob_range(layer.digest, part.start, part.end) as response:
            _check_answer(client, response, layer, size, part)
            return _write_part(client, response, layer, fd, part, on_bytes)
    except BaseException:
        cancel.set()  # the other parts stop at their next chunk
        raise


def _refusal(client: RegistryClient, layer: Layer, part: Part) -> Callable[[str], RegistryUnavailable]:
    registry = client.reference.registry
    what = range_what(layer.digest, part.start, part.end)
    return lambda why: RegistryUnavailable(registry, f"registry {registry} answered {what} ({layer.path}) with "
                                                     f"{why}", hint=RANGE_HINT)


def _check_answer(client: RegistryClient, response: Any, layer: Layer, size: int, part: Part) -> None:
    """A part's answer is a 206 of exactly the bytes asked, not encoded (its headers: the body is
    bounded as it is read, _write_part)."""
    refuse = _refusal(client, layer, part)
    status, headers = response.status_code, response.headers
    if status != 206:
        raise refuse(f"HTTP {status} (the whole blob), after answering the first range with 206")
    encoding = " ".join(str(headers.get("Content-Encoding", "")).split()).lower()
    if encoding not in ("", "identity"):
        raise refuse(f"Content-Encoding {encoding[:40]!r}, a range of encoded bytes")
    content_range = " ".join(str(headers.get("Content-Range", "")).split())
    match = _CONTENT_RANGE.fullmatch(content_range)
    if match is None or (int(match[1]), int(match[2])) != (part.start, part.end) or match[3] not in ("*", str(size)):
        raise refuse(f"Content-Range {content_range[:80]!r}; vsnap asked for bytes {part.start}-{part.end}/{size}")
    length = headers.get("Content-Length")
    if length is not None and str(length).strip() != str(part.length):
        raise refuse(f"Content-Length {str(length)[:40]!r}; the range is {part.length} bytes")


def _write_part(client: RegistryClient, response: Any, layer: Layer, fd: int, part: Part,
                on_bytes: Callable[[int], None]) -> list[str]:
    """Write a checked part's body at its offset, never past its end; its pieces' hex sha256."""
    refuse = _refusal(client, layer, part)
    what = range_what(layer.digest, part.start, part.end)
    digest = FileDigest()
    offset = part.start

    def too_long() -> RegistryUnavailable:
        return refuse(f"more than the {part.length} bytes asked")

    pending: list[bytes] = []  # read, not yet written: written together once WRITE_BYTES are there
    pending_at = offset
    for chunk in client.body(response, what, limit=part.length, too_long=too_long, piece=READ_BYTES):
        on_bytes(len(chunk))  # raises Cancelled once the pull is cancelled
        digest.update(chunk)
        pending.append(chunk)
        offset += len(chunk)
        if offset - pending_at >= WRITE_BYTES or len(pending) >= _MAX_IOV:
            _write_at(fd, pending, pending_at)
            pending, pending_at = [], offset
    _write_at(fd, pending, pending_at)
    if offset - part.start != part.length:
        raise refuse(f"{offset - part.start} bytes, then the end of the body; the range is {part.length} bytes")
    return digest.piece_digests()


def _write_at(fd: int, chunks: list[bytes], at: int) -> None:
    """``chunks``, one after the other, into the preallocated file at ``at``: one pwritev, no copy,
    so the kernel sees one write of their length; nothing where they are all zeros (the file reads
    zeros there). Zeros beside data in one write are written: on a filesystem without fallocate
    they take blocks that 1 MiB writes would have left as holes."""
    if all(_zeros(chunk) for chunk in chunks):
        return
    views, end = [memoryview(chunk) for chunk in chunks], at + sum(len(chunk) for chunk in chunks)
    while at < end:
        written = os.pwritev(fd, views, at)
        at += written
        while views and written >= len(views[0]):
            written -= len(views[0])
            views.pop(0)
        if written:
            views[0] = views[0][written:]


@functools.cache
def _fallocate() -> Any | None:
    """The C library's fallocate(2), typed; None where it has none (os has only posix_fallocate)."""
    function = getattr(ctypes.CDLL(None, use_errno=True), "fallocate", None)
    if function is not None:
        function.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
        function.restype = ctypes.c_int
    return function


def preallocate(fd: int, size: int) -> None:
    """Give the empty file ``fd`` its ``size`` and its blocks at once (fallocate(2), mode 0):
    the parts' pwrites then only fill blocks (4 GiB in 2 parts on the 2-core VM: 6.0 s instead of
    8.4, less kernel time: docs/benchmarks/pull-ranged-2026-12-04.md), and a disk too full for the
    file fails here (OSError ENOSPC: the pull's disk-full error), before a part is written. Where
    the filesystem cannot (EOPNOTSUPP; glibc's posix_fallocate would write a byte into every block
    instead), the file is only sized (ftruncate: sparse)."""
    function = _fallocate()
    if function is not None:
        if function(fd, 0, 0, size) == 0:
            return
        code = ctypes.get_errno()
        if code not in (errno.EOPNOTSUPP, errno.ENOSYS):
            raise OSError(code, os.strerror(code))
    os.ftruncate(fd, size)


def _zeros(chunk: bytes) -> bool:
    """Is ``chunk`` all zeros (not written: the preallocated file reads zeros there)? Cheap for
    data: the first or last byte usually says no."""
    if not chunk or chunk[0] or chunk[-1]:
        return False
    return chunk == (_ZEROS if len(chunk) == READ_BYTES else bytes(len(chunk)))
