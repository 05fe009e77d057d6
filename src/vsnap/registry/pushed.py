"""Which blobs this host already made of an image's files, so a push does not make them again.

The digest of a compressed blob is known only once the file is compressed, and that of the
weights file only once its 16 GB are hashed. A push that ends (or is killed) after some blobs
records here, for each file sent, the blob made of it (encoding, digest, size) under the file's
identity (device, inode, size, mtime, ctime, as in host.verified): the next push of that image
asks the registry for those digests (HEAD) and sends only what it lacks. Root-only, under /run:
a reboot forgets it, and a push then recomputes what it needs. Read and written as host.verified's
records are (read_cache, write_cache): a record that is not exactly PushedImage is no record.
"""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path
from typing import Literal

from vsnap.host import verified
from vsnap.host.paths import RUNTIME_DIR
from vsnap.protocol.records import Record, RecordError, field

from .oci import Layer

PUSHED_DIR = RUNTIME_DIR / "pushed"


class PushedBlob(Record):
    """The blob made of one file: under the file's identity then (verified.identity)."""

    identity: list[int]
    encoding: Literal["raw", "zstd"]
    digest: str                           # the blob's "sha256:..."
    size: int = field(ge=0)               # the blob's bytes


class PushedImage(Record):
    """``<root>/<hash of the image's path>.json``: the blobs made of an image's files, by relative path."""

    image: str  # the image directory, resolved: a record found under another image's name is not believed
    files: dict[str, PushedBlob]


class PushedBlobs:
    """The record of one image directory (loaded once, written after each blob)."""

    def __init__(self, image_dir: Path, root: Path = PUSHED_DIR) -> None:
        self._image = str(image_dir.resolve())
        self._root = root
        self._name = hashlib.sha256(os.fsencode(self._image)).hexdigest()[:32] + ".json"
        self._lock = threading.Lock()
        self._files: dict[str, PushedBlob] = self._load()

    def _load(self) -> dict[str, PushedBlob]:
        """What the record says, if it is believed (verified.read_cache) and of this image; else {}."""
        cached = verified.read_cache(self._root, self._name, PushedImage)
        return dict(cached.files) if cached is not None and cached.image == self._image else {}

    def known(self, rel: str, st: os.stat_result, encoding: str) -> Layer | None:
        """The blob made of this file before, if the file did not change since."""
        entry = self._files.get(rel)
        ident = verified.identity(st)
        if entry is None or ident is None or entry.identity != ident or entry.encoding != encoding:
            return None
        return Layer(rel, entry.encoding, entry.digest, entry.size)

    def remember(self, layer: Layer, st: os.stat_result) -> None:
        ident = verified.identity(st)
        if ident is None:
            return
        with self._lock:
            try:
                self._files[layer.path] = PushedBlob(identity=ident, encoding=layer.encoding, digest=layer.digest,
                                                     size=layer.size)
                record = PushedImage(image=self._image, files=self._files)
            except RecordError:
                self._files.pop(layer.path, None)
                return  # a path or an identity no record can hold: that blob is only made again
            verified.write_cache(self._root, self._name, record)  # only a cache: a failure is not an error
