"""Which blobs this host already made of an image's files, so a push does not make them again.

The digest of a compressed blob is known only once the file is compressed, and that of the
weights file only once its 16 GB are hashed. A push that ends (or is killed) after some blobs
records here, for each file sent, the blob made of it (encoding, digest, size) under the file's
identity (device, inode, size, mtime, ctime, as in _verified): the next push of that image
asks the registry for those digests (HEAD) and sends only what it lacks. Root-only, under /run:
a reboot forgets it, and a push then recomputes what it needs.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path

from vsnap.host import verified
from vsnap.host.paths import RUNTIME_DIR
from vsnap.protocol.control import write_atomic

from .oci import Layer

PUSHED_DIR = RUNTIME_DIR / "pushed"


class PushedBlobs:
    """The record of one image directory (loaded once, written after each blob)."""

    def __init__(self, image_dir: Path, root: Path = PUSHED_DIR) -> None:
        self._image = str(image_dir.resolve())
        self._root = root
        self._name = hashlib.sha256(os.fsencode(self._image)).hexdigest()[:32] + ".json"
        self._lock = threading.Lock()
        self._files: dict[str, dict] = self._load()

    def _load(self) -> dict[str, dict]:
        try:
            if not (verified._private(self._root) and verified._private(self._root / self._name)):
                return {}  # a record anyone else could have written is no record
            data = json.loads((self._root / self._name).read_text())
        except (OSError, ValueError):
            return {}
        if not isinstance(data, dict) or data.get("image") != self._image or not isinstance(data.get("files"), dict):
            return {}
        return data["files"]

    def known(self, rel: str, st: os.stat_result, encoding: str) -> Layer | None:
        """The blob made of this file before, if the file did not change since."""
        entry = self._files.get(rel)
        ident = verified.identity(st)
        if not isinstance(entry, dict) or ident is None or entry.get("identity") != ident \
                or entry.get("encoding") != encoding or not isinstance(entry.get("digest"), str) \
                or not isinstance(entry.get("size"), int):
            return None
        return Layer(rel, encoding, entry["digest"], entry["size"])  # type: ignore[arg-type]

    def remember(self, layer: Layer, st: os.stat_result) -> None:
        ident = verified.identity(st)
        if ident is None:
            return
        with self._lock:
            self._files[layer.path] = {"identity": ident, "encoding": layer.encoding, "digest": layer.digest,
                                       "size": layer.size}
            data = json.dumps({"image": self._image, "files": self._files}).encode()
            try:
                if verified.writable_root(self._root):
                    write_atomic(self._root, self._name, data)
            except OSError:
                pass  # only a cache: the next push recomputes
