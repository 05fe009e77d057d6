"""Where each tensor's bytes lie in a .safetensors file, read from its header alone, every field
treated as hostile (the model's files are root's and hashed into the image, but a header that
lies must cost nothing worse than a file left out).

The format: 8 bytes, the header's length N (little-endian unsigned); N bytes of JSON, an object
mapping each tensor's name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets from
the end of the header) plus an optional ``"__metadata__"``; then the data. No torch, no
safetensors package: the engine's worker reads the headers of the files vLLM loaded from.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from typing import Any

# A shard's header has tens of KB (an 8B model's: ~30 KB). The safetensors package takes up to 100 MB, but
# a 99 MB header of 3 million tensors costs the matcher 16 s and 2.2 GB in the tree about to be
# frozen: a file whose header is over 16 MB is left out (its tensors stay in the weights file).
MAX_HEADER_BYTES = 16_000_000


class UnusableHeader(ValueError):
    """The file's header cannot be trusted to say where its tensors are: the file is left out."""


@dataclass(frozen=True)
class CheckpointTensor:
    """One tensor of a model file: its bytes are the file's [offset, offset + nbytes)."""

    name: str
    offset: int  # from the start of the file
    nbytes: int


def read_header(fd: int, size: int) -> list[CheckpointTensor]:
    """The tensors of the open file ``fd`` (``size`` bytes), sorted by offset. Raises UnusableHeader
    when the header is too short, too long, not a JSON object, has a name twice, or a tensor whose
    offsets are not two integers within the data, or two tensors whose bytes overlap."""
    if size < 8:
        raise UnusableHeader(f"{size} bytes: too short for a safetensors header")
    (length,) = struct.unpack("<Q", _pread(fd, 8, 0))
    if length > MAX_HEADER_BYTES:
        raise UnusableHeader(f"header length {length} is over {MAX_HEADER_BYTES}")
    if 8 + length > size:
        raise UnusableHeader(f"header length {length} runs past the end of the file ({size} bytes)")
    try:
        header = json.loads(_pread(fd, length, 8), object_pairs_hook=_no_duplicates)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise UnusableHeader(f"header is not JSON ({type(exc).__name__})") from None
    if not isinstance(header, dict):
        raise UnusableHeader("header is not a JSON object")
    data_start, data_size = 8 + length, size - 8 - length
    tensors = [_tensor(name, entry, data_start, data_size) for name, entry in header.items() if name != "__metadata__"]
    tensors.sort(key=lambda t: (t.offset, t.nbytes))
    reach: CheckpointTensor | None = None  # of the tensors so far (not empty), the one that ends last
    for tensor in tensors:
        if not tensor.nbytes:
            continue
        if reach is not None and tensor.offset < reach.offset + reach.nbytes:
            raise UnusableHeader(f"tensors {reach.name[:200]!r} and {tensor.name[:200]!r} overlap")
        if reach is None or tensor.offset + tensor.nbytes > reach.offset + reach.nbytes:
            reach = tensor
    return tensors


def _tensor(name: str, entry: Any, data_start: int, data_size: int) -> CheckpointTensor:
    offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
        raise UnusableHeader(f"tensor {name[:200]!r} has no data_offsets [begin, end]")
    begin, end = offsets
    if not 0 <= begin <= end <= data_size:
        raise UnusableHeader(f"tensor {name[:200]!r} has data_offsets [{begin}, {end}] outside the file's "
                             f"{data_size} data bytes")
    return CheckpointTensor(name, data_start + begin, end - begin)


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result = dict(pairs)
    if len(result) != len(pairs):
        raise ValueError("a name is given twice")
    return result


def _pread(fd: int, n: int, offset: int) -> bytes:
    chunks, done = [], 0
    while done < n:
        chunk = os.pread(fd, n - done, offset + done)
        if not chunk:
            raise UnusableHeader(f"file ended at byte {offset + done}")
        chunks.append(chunk)
        done += len(chunk)
    return b"".join(chunks)
