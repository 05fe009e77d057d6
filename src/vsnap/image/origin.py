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
import json
import os
from pathlib import Path

from vsnap.protocol import control

from .manifest import MANIFEST, MAX_MANIFEST_BYTES

MAX_ORIGIN_BYTES = 4096


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
    body = json.dumps({"reference": reference, "manifest_sha256": digest}).encode()
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
        record = json.loads(data)
        reference, digest = str(record["reference"]), str(record["manifest_sha256"])
    except (ValueError, KeyError, TypeError, RecursionError):
        return None
    return reference if digest == manifest_sha256(image_dir) else None
