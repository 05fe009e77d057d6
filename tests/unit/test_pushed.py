"""The record of blobs a push made (registry/pushed) is believed only while it is exactly the record
vsnap writes (protocol.records), root's alone and of this image (test_oci: until the file changes)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable

import pytest

from vsnap.registry.oci import Layer
from vsnap.registry.pushed import PushedBlobs

DIGEST = "sha256:" + "a" * 64


def _file(tmp_path: Path) -> tuple[Path, Path, os.stat_result]:
    image = tmp_path / "img"
    (image / "criu").mkdir(parents=True, mode=0o700)
    path = image / "criu" / "pages-1.img"
    path.write_bytes(b"pages")
    os.chmod(path, 0o600)
    return image, tmp_path / "pushed", os.lstat(path)


@pytest.mark.parametrize("change", [
    lambda d, e: {**d, "extra": 1},
    lambda d, e: {**d, "image": "/another/image"},                # another image's record (a renamed file)
    lambda d, e: {**d, "files": {"criu/pages-1.img": {**e, "size": "3"}}},
    lambda d, e: {**d, "files": {"criu/pages-1.img": {**e, "size": -1}}},
    lambda d, e: {**d, "files": {"criu/pages-1.img": {**e, "encoding": "gzip"}}},
    lambda d, e: {**d, "files": {"criu/pages-1.img": {**e, "digest": None}}},
    lambda d, e: {**d, "files": {"criu/pages-1.img": []}},
    lambda d, e: [d],
])
def test_a_record_not_exactly_vsnaps_is_no_record(tmp_path: Path, change: Callable[[dict, dict], object]) -> None:
    image, root, st = _file(tmp_path)
    PushedBlobs(image, root).remember(Layer("criu/pages-1.img", "zstd", DIGEST, 3), st)
    (record,) = root.iterdir()
    document = json.loads(record.read_text())
    record.write_text(json.dumps(change(document, document["files"]["criu/pages-1.img"])))
    assert PushedBlobs(image, root).known("criu/pages-1.img", st, "zstd") is None


def test_a_record_others_could_write_is_no_record(tmp_path: Path) -> None:
    image, root, st = _file(tmp_path)
    PushedBlobs(image, root).remember(Layer("criu/pages-1.img", "raw", DIGEST, 5), st)
    (record,) = root.iterdir()
    os.chmod(record, 0o644)
    assert PushedBlobs(image, root).known("criu/pages-1.img", st, "raw") is None
