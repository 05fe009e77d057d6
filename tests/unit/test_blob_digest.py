"""A blob is checked against its file's digest by the file's scheme: a model file's is its plain
sha256 whatever its size (image files over 64 MiB are hashed by pieces), and a raw blob whose
file digest is a plain sha256 is hashed once, not twice."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import pytest

from vsnap.image.manifest import FileEntry
from vsnap.image.store import PIECE, piece_hashes
from vsnap.protocol.errors import ArtifactError
from vsnap.registry import blobio
from vsnap.registry.blobio import write_blob
from vsnap.registry.oci import Layer

SIZE = PIECE + 4096  # past one piece: where the two schemes differ


@pytest.fixture(scope="module")
def data() -> bytes:
    return os.urandom(SIZE)


def chunks(data: bytes, size: int = 1 << 20) -> list[bytes]:
    return [data[i:i + size] for i in range(0, len(data), size)]


def written(tmp_path: Path, data: bytes, entry: FileEntry) -> bytes:
    layer = Layer("model-00001.safetensors", "raw", "sha256:" + hashlib.sha256(data).hexdigest(), len(data))
    fd = os.open(tmp_path / "out", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        write_blob(chunks(data), layer, entry, fd, "REF")
    finally:
        os.close(fd)
    return (tmp_path / "out").read_bytes()


def test_a_model_file_over_a_piece_is_checked_by_its_plain_sha256(tmp_path: Path, data: bytes) -> None:
    entry = FileEntry(size=SIZE, digest=hashlib.sha256(data).hexdigest(), scheme="sha256")
    assert written(tmp_path, data, entry) == data  # it was refused: its pieces' digest was compared


def test_an_image_file_over_a_piece_is_still_checked_by_its_pieces(tmp_path: Path, data: bytes) -> None:
    (tmp_path / "f").write_bytes(data)
    pieces = piece_hashes(tmp_path, {"f": SIZE})["f"]
    assert written(tmp_path, data, FileEntry(size=SIZE, digest=pieces, scheme="sha256-of-64MiB-pieces")) == data
    with pytest.raises(ArtifactError, match="does not match manifest.json"):
        written(tmp_path, data, FileEntry(size=SIZE, digest=hashlib.sha256(data).hexdigest(),
                                          scheme="sha256-of-64MiB-pieces"))


def test_a_raw_blob_whose_file_digest_is_its_sha256_is_hashed_once(
        tmp_path: Path, data: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    hashed: list[int] = []
    real = hashlib.sha256

    class Counting:
        def __init__(self, *args: bytes) -> None:
            self._h = real(*args)

        def update(self, chunk: bytes | memoryview) -> None:
            hashed.append(len(chunk))
            self._h.update(chunk)

        def hexdigest(self) -> str:
            return self._h.hexdigest()

    monkeypatch.setattr(blobio.hashlib, "sha256", Counting)
    entry = FileEntry(size=SIZE, digest=real(data).hexdigest(), scheme="sha256")
    assert written(tmp_path, data, entry) == data
    assert sum(hashed) == SIZE  # the blob's sha256 only; it was hashed a second time as the file's


def test_a_model_blob_of_other_bytes_is_refused_naming_the_file(tmp_path: Path, data: bytes) -> None:
    entry = FileEntry(size=SIZE, digest=hashlib.sha256(b"other" + data[5:]).hexdigest(), scheme="sha256")
    with pytest.raises(ArtifactError, match="model-00001.safetensors does not match manifest.json"):
        written(tmp_path, data, entry)


def test_a_blob_is_written_in_whole_chunks_at_chunk_offsets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A registry's body comes in small pieces (256 KiB); the file gets CHUNK-byte writes at CHUNK
    offsets (the rest last), so that its page cache is in 2 MiB folios (blobio.CHUNK says why), and
    a CHUNK of zeros stays a hole."""
    size = 3 * blobio.CHUNK + 12345
    data = bytearray(os.urandom(size))
    data[blobio.CHUNK:2 * blobio.CHUNK] = bytes(blobio.CHUNK)
    data = bytes(data)
    writes: list[tuple[int, int]] = []
    real = os.write

    def spy(fd: int, buffer: Any) -> int:
        writes.append((os.lseek(fd, 0, os.SEEK_CUR), len(buffer)))
        return real(fd, buffer)

    monkeypatch.setattr(blobio.os, "write", spy)
    layer = Layer("model-00001.safetensors", "raw", "sha256:" + hashlib.sha256(data).hexdigest(), size)
    entry = FileEntry(size=size, digest=hashlib.sha256(data).hexdigest(), scheme="sha256")
    fd = os.open(tmp_path / "out", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        write_blob([data[i:i + (256 << 10)] for i in range(0, size, 256 << 10)], layer, entry, fd, "REF")
    finally:
        os.close(fd)
    assert (tmp_path / "out").read_bytes() == data
    assert writes == [(0, blobio.CHUNK), (2 * blobio.CHUNK, blobio.CHUNK), (3 * blobio.CHUNK, 12345)]
