"""How a ranged pull's part reaches the file: its 1 MiB reads are written together, WRITE_BYTES at
a time at offsets that are multiples of it, so that the page cache holds the pulled file in large
folios (why: ranged.WRITE_BYTES; measured with scripts/page-lock-probe.c, docs/benchmarks/NOTES.md
session 15). A fake client's body; the file and its writes are real."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator

import pytest

from vsnap.image.store import PIECE
from vsnap.registry import ranged
from vsnap.registry.oci import Layer


class Body:
    """A registry client's body: ``data`` in pieces of ``piece`` bytes (as transport.body yields)."""

    def __init__(self, data: bytes, piece: int) -> None:
        self.data, self.piece = data, piece
        self.reference = SimpleNamespace(registry="127.0.0.1:5000")

    def body(self, response: Any, what: str, *, limit: int, too_long: Any, piece: int) -> Iterator[bytes]:
        for at in range(0, len(self.data), self.piece):
            yield self.data[at:at + self.piece]


def write_part(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, data: bytes, start: int,
               piece: int = ranged.READ_BYTES) -> tuple[bytes, list[tuple[int, int]]]:
    """Write ``data`` as the part at ``start`` of a file; (the file's bytes there, the pwritev calls
    as (offset, bytes))."""
    calls: list[tuple[int, int]] = []
    real = os.pwritev

    def spy(fd: int, buffers: Any, offset: int) -> int:
        calls.append((offset, sum(len(b) for b in buffers)))
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "pwritev", spy)
    path = tmp_path / "blob"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, start + len(data))
        part = ranged.Part(start, start + len(data) - 1)
        layer = Layer(path="weights/rank0.bin", encoding="raw", digest="sha256:" + "0" * 64, size=start + len(data))
        ranged._write_part(Body(data, piece), None, layer, fd, part, lambda n: None)  # type: ignore[arg-type]
        return os.pread(fd, len(data), start), calls
    finally:
        os.close(fd)


def test_a_part_is_written_in_aligned_writes_of_write_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    size = 3 * ranged.WRITE_BYTES + 12345  # the last write is the rest
    data = bytes(range(256)) * (size // 256) + b"\x01" * (size % 256)
    written, calls = write_part(tmp_path, monkeypatch, data, PIECE)
    assert written == data
    assert calls[:-1] == [(PIECE + k * ranged.WRITE_BYTES, ranged.WRITE_BYTES) for k in range(3)]
    assert calls[-1] == (PIECE + 3 * ranged.WRITE_BYTES, 12345)
    assert all(offset % (2 << 20) == 0 for offset, _ in calls)  # 2 MiB: a folio the kernel maps with one entry


def test_all_zero_writes_are_left_as_holes_and_data_around_them_lands(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    w = ranged.WRITE_BYTES
    data = b"\x07" * w + bytes(w) + b"\x09" * 100
    written, calls = write_part(tmp_path, monkeypatch, data, 0)
    assert written == data
    assert [offset for offset, _ in calls] == [0, 2 * w]


def test_small_pieces_are_written_in_bounded_vectors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A registry whose pieces are tiny: no more than _MAX_IOV of them in one pwritev (IOV_MAX is 1024)."""
    data = os.urandom(ranged._MAX_IOV * 3 * 100 + 7)
    written, calls = write_part(tmp_path, monkeypatch, data, 0, piece=100)
    assert written == data
    assert all(length <= ranged._MAX_IOV * 100 for _, length in calls) and len(calls) == 4
