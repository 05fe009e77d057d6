"""dma_into on a real GPU: a file in the page cache, page-locked piece by piece and copied by the
GPU, lands byte for byte in tensors whose boundaries fall anywhere in the pieces (the GPU machine
only: `pytest -m gpu tests/gpu/test_weights_dma.py`)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")
pytest.importorskip("cuda.bindings")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from vsnap.engine.adapters.vllm.weights.copiers import DMA_ENV, dma_into, stream_into  # noqa: E402
from vsnap.engine.adapters.vllm.weights.layout import Segment  # noqa: E402


def _layout(sizes: list[int]) -> list[Segment]:
    segments, offset = [], 0
    for k, n in enumerate(sizes):
        segments.append(Segment(f"s{k}", offset, n, "torch.uint8", (n,)))
        offset += n
    return segments


# (1 MiB, 1 thread, 3 held): 8 pieces, so the thread unlocks pieces while it locks others
@pytest.mark.parametrize("piece,threads,held", [(1 << 20, 3, 2), (3 << 20, 3, 2), (64 << 20, 3, 2), (1 << 20, 3, 16),
                                                (1 << 20, 1, 3)])
def test_dma_into_copies_every_byte(tmp_path: Path, piece: int, threads: int, held: int) -> None:
    sizes = [1, (5 << 20) + 13, 4096, 0, (2 << 20) - 1, 777]
    segments = _layout(sizes)
    data = os.urandom(sum(sizes))
    path = tmp_path / "rank0.bin"
    path.write_bytes(data)
    targets = [torch.zeros(n, dtype=torch.uint8, device="cuda") for n in sizes]
    result = dma_into(path, segments, targets, threads=threads, piece=piece, held=held)
    assert result["weights_bytes"] == len(data)
    assert result["weights_registered_pieces"] == -(-len(data) // piece)
    for seg, target in zip(segments, targets):
        assert bytes(target.cpu().numpy()) == data[seg.offset:seg.offset + seg.nbytes], seg.name
    assert str(path) not in Path("/proc/self/maps").read_text()  # unmapped, so nothing of it is still locked


def test_stream_into_takes_dma_by_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sizes = [3 << 20, 12345]
    data = os.urandom(sum(sizes))
    path = tmp_path / "rank0.bin"
    path.write_bytes(data)
    targets = [torch.zeros(n, dtype=torch.uint8, device="cuda") for n in sizes]
    monkeypatch.delenv(DMA_ENV, raising=False)  # the default
    result = stream_into(path, _layout(sizes), targets)
    assert result["weights_registered_pieces"] >= 1
    assert b"".join(bytes(t.cpu().numpy()) for t in targets) == data


def test_unlock_later_leaves_the_pieces_locked_until_released(tmp_path: Path) -> None:
    sizes = [(3 << 20) + 5, 4096, (1 << 20) - 3]
    data = os.urandom(sum(sizes))
    path = tmp_path / "rank0.bin"
    path.write_bytes(data)
    targets = [torch.zeros(n, dtype=torch.uint8, device="cuda") for n in sizes]
    handed: list = []
    result = dma_into(path, _layout(sizes), targets, threads=2, piece=1 << 20, held=16, unlock_later=handed.append)
    assert b"".join(bytes(t.cpu().numpy()) for t in targets) == data
    [pages] = handed
    assert pages.pieces == result["weights_unlocked_later_pieces"] == result["weights_registered_pieces"] == 5
    assert str(path) in Path("/proc/self/maps").read_text()  # still mapped: its pages are locked
    assert pages.release(pause_s=0.001)["unlocked_pieces"] == 5
    assert str(path) not in Path("/proc/self/maps").read_text()
