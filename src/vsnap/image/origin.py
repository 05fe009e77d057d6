"""Where a pulled image came from: a small record beside it, ``.NAME.origin``.

A pull keeps the image's manifest.json byte for byte (its digest is what the registry served), so
the registry reference cannot go inside the image. The record names the reference and the sha256
of the manifest.json it was pulled with; `vsnap images` shows the reference only while the
image's manifest.json still has that digest (an image captured again at that path, or pulled from
elsewhere, is not mislabelled by a stale record). Written atomically by root into the image's
parent (which the pull checked is root's alone), read without following links.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from vsnap.protocol import control
from vsnap.protocol.records import Record, RecordError

from .manifest import MANIFEST, MAX_MANIFEST_BYTES

MAX_ORIGIN_BYTES = 4096


class Origin(Record):
    """``.NAME.origin``: the reference an image was pulled from, and the manifest.json it came with."""

    reference: str
    manifest_sha256: str


def origin_name(image_dir: Path) -> str:
    return f".{image_dir.name}.origin"


def manifest_sha256(image_dir: Path) -> str | None:
    """sha256 of the image's manifest.json, read following only root's links (None if unreadable)."""
    from vsnap.host.trust import open_following_only_roots_links

    try:
        fd = open_following_only_roots_links(image_dir / MANIFEST)
    except Exception:
        return None
    try:
        data = os.read(fd, MAX_MANIFEST_BYTES + 1)
    finally:
        os.close(fd)
    return hashlib.sha256(data).hexdigest() if len(data) <= MAX_MANIFEST_BYTES else None


def record_origin(image_dir: Path, reference: str) -> None:
    """After a pull published ``image_dir``: remember the reference it came from."""
    digest = manifest_sha256(image_dir)
    if digest is None:
        return
    try:
        body = Origin(reference=reference, manifest_sha256=digest).model_dump_json().encode()
    except RecordError:
        return  # a reference that is not valid text: only a label, and the image is published
    try:
        control.write_atomic(image_dir.parent, origin_name(image_dir), body)
    except OSError:
        pass  # something else stands at that name (another user's directory in a sticky parent): only
        # a label, and the image is published; `vsnap images` then shows it as the manifest says


def read_origin(image_dir: Path) -> str | None:
    """The reference ``image_dir`` was pulled from, if its record matches its manifest.json now."""
    try:
        data = control.read_bytes(image_dir.parent, origin_name(image_dir))
    except control.ControlProtocolError:
        return None  # a link, another user's file: not ours, not believed
    if data is None or len(data) > MAX_ORIGIN_BYTES:
        return None
    try:
        record = Origin.model_validate_json(data)
    except RecordError:
        return None  # not exactly the record vsnap writes: not believed
    return record.reference if record.manifest_sha256 == manifest_sha256(image_dir) else None
