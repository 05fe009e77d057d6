"""The weights file's layout and streaming, on CPU tensors (the GPU test covers pinned CUDA copies)."""

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from vsnap.engine.adapters.vllm_weights import flat_bytes, layout, stream_into  # noqa: E402


def _params() -> list[tuple[str, "torch.Tensor"]]:
    g = torch.Generator().manual_seed(0)
    return [("embed", torch.randn(37, 11, generator=g).to(torch.bfloat16)),
            ("norm", torch.randn(11, generator=g)),
            ("proj", torch.randn(5, 7, 3, generator=g).to(torch.float16)),
            ("bias", torch.randint(0, 255, (1,), dtype=torch.uint8))]


def _write(path: Path, named: list) -> None:
    with open(path, "wb") as f:
        for _, t in named:
            f.write(memoryview(flat_bytes(t).numpy()))


@pytest.mark.parametrize("chunk,threads", [(64, 3), (7, 2), (1 << 20, 8)])
def test_stream_into_restores_every_byte(tmp_path: Path, chunk: int, threads: int) -> None:
    named = _params()
    segments = layout(named)
    assert [s.offset for s in segments] == [0, 814, 858, 1068] and segments[-1].nbytes == 1
    path = tmp_path / "rank0.bin"
    _write(path, named)
    empty = [torch.zeros_like(t) for _, t in named]
    result = stream_into(path, segments, [flat_bytes(t) for t in empty], threads=threads, chunk=chunk)
    assert result["weights_bytes"] == 1069
    for (name, want), got in zip(named, empty):
        assert torch.equal(want, got), name


def test_a_file_of_another_size_is_refused(tmp_path: Path) -> None:
    named = _params()
    path = tmp_path / "rank0.bin"
    _write(path, named[:-1])
    with pytest.raises(ValueError, match="1068 bytes; the parameters need 1069"):
        stream_into(path, layout(named), [flat_bytes(t) for _, t in named])
