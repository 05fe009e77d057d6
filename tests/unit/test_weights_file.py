"""The weights file's layout and streaming, on CPU tensors (the GPU test covers pinned CUDA copies)."""

import contextlib
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from vsnap.engine.adapters.vllm.weights.copiers import stream_into  # noqa: E402
from vsnap.engine.adapters.vllm.weights.layout import flat_bytes, layout  # noqa: E402


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


def test_pool_tensors_finds_every_tensor_of_the_pool_and_refills_it(tmp_path: Path) -> None:
    """Parameters, a scale kept as a plain attribute and a transposed (non-contiguous) parameter
    are carried; buffers (vLLM puts them back) and tensors outside the pool are not; objects gc
    froze are found too; the file refills them byte for byte."""
    import gc

    from vsnap.engine.adapters.vllm.weights.layout import fingerprint
    from vsnap.engine.adapters.vllm.weights.pool import pool_tensors

    model = torch.nn.Linear(8, 16)
    model.weight = torch.nn.Parameter(torch.randn(8, 16).t(), requires_grad=False)  # like FP8's qweight.t()
    model.weight_scale_plain = torch.tensor([0.5, 2.0])  # not a parameter, not a buffer
    model.register_buffer("cache", torch.ones(4))
    outside = torch.zeros(64)
    inside = [model.weight, model.bias, model.weight_scale_plain, model.cache]
    ranges = [(t.untyped_storage().data_ptr(), t.untyped_storage().data_ptr() + t.untyped_storage().nbytes())
              for t in inside]
    gc.freeze()
    try:
        named = pool_tensors(model, ranges, device="cpu")
    finally:
        gc.unfreeze()
    names = [name for name, _ in named]
    assert set(names) >= {"weight", "bias"} and len(names) == 3, names
    assert any(name.startswith("tensor@") for name in names)
    assert all(t.untyped_storage().data_ptr() != outside.untyped_storage().data_ptr() for _, t in named)
    assert all(t.untyped_storage().data_ptr() != model.cache.untyped_storage().data_ptr() for _, t in named)
    before = fingerprint([("w", model.weight), ("b", model.bias), ("s", model.weight_scale_plain)])
    path = tmp_path / "rank0.bin"
    with open(path, "wb") as f:
        for _, view in named:
            f.write(memoryview(view.numpy()))
    for _, view in named:
        view.zero_()
    assert fingerprint([("w", model.weight)]) != {"w": before["w"]}
    stream_into(path, layout(named), [view for _, view in named], threads=2, chunk=16)
    assert fingerprint([("w", model.weight), ("b", model.bias), ("s", model.weight_scale_plain)]) == before


def test_views_of_one_storage_are_carried_once() -> None:
    from vsnap.engine.adapters.vllm.weights.pool import pool_tensors

    base = torch.zeros(32)
    model = torch.nn.Module()
    model.a = torch.nn.Parameter(base, requires_grad=False)
    model.view = base[4:]  # a slice: the same storage, carried once under the parameter's name
    ptr = base.untyped_storage().data_ptr()
    named = pool_tensors(model, [(ptr, ptr + 128)], device="cpu")
    assert [name for name, _ in named] == ["a"]


def test_fingerprint_sees_swapped_bytes_and_buffers_that_are_views_of_parameters() -> None:
    """Moved bytes change the checksum (a plain sum would not); a buffer that is a view of a
    parameter's storage (Mamba2's conv_weights) does not keep that storage out of the file."""
    from vsnap.engine.adapters.vllm.weights.layout import fingerprint
    from vsnap.engine.adapters.vllm.weights.pool import pool_tensors

    a = torch.arange(16, dtype=torch.int32)
    b = torch.cat([a[8:], a[:8]])
    assert fingerprint([("t", a)]) != fingerprint([("t", b)])
    model = torch.nn.Module()
    model.conv = torch.nn.Linear(4, 4, bias=False)
    model.register_buffer("conv_weights", model.conv.weight.view(16), persistent=False)
    model.register_buffer("own", torch.ones(3))
    storages = [model.conv.weight.untyped_storage(), model.own.untyped_storage()]
    ranges = [(st.data_ptr(), st.data_ptr() + st.nbytes()) for st in storages]
    names = [name for name, _ in pool_tensors(model, ranges, device="cpu")]
    assert names == ["conv.weight"], names


def test_refresh_rewrites_the_pieces_that_changed_since_the_save(tmp_path: Path) -> None:
    """What the oracle and the rehearsal change after the save (LoRA slots) is written again in place."""
    from vsnap.engine.adapters.vllm.weights.extension import WeightsFileExtension
    from vsnap.engine.adapters.vllm.weights.layout import fingerprint, storage_view

    tensors = [storage_view(torch.arange(8, dtype=torch.int32)), storage_view(torch.zeros(4, dtype=torch.int32))]
    named = [("slots", tensors[0]), ("other", tensors[1])]
    ext = WeightsFileExtension.__new__(WeightsFileExtension)
    ext._vsnap_layout, ext._vsnap_targets, ext._vsnap_sums = layout(named), tensors, fingerprint(named)
    with open(tmp_path / "rank0.bin", "wb") as f:
        for t in tensors:
            f.write(memoryview(t.numpy()))
    assert ext.vsnap_refresh_weights(str(tmp_path))["refreshed_tensors"] == 0
    tensors[0].view(torch.int32).copy_(torch.arange(8, dtype=torch.int32).flip(0))  # slots swapped
    assert ext.vsnap_refresh_weights(str(tmp_path))["refreshed_tensors"] == 1
    assert (tmp_path / "rank0.bin").read_bytes() == tensors[0].numpy().tobytes() + tensors[1].numpy().tobytes()


def test_overlaps_are_each_segments_part_of_a_range() -> None:
    """Against a byte-by-byte answer, for every range over a layout with empty and one-byte segments."""
    from vsnap.engine.adapters.vllm.weights.copiers import _overlaps
    from vsnap.engine.adapters.vllm.weights.layout import Segment

    sizes = [5, 0, 1, 7, 0, 3]
    segments, offset = [], 0
    for k, n in enumerate(sizes):
        segments.append(Segment(f"s{k}", offset, n, "torch.uint8", (n,)))
        offset += n
    starts = [s.offset for s in segments]
    owner = [k for k, n in enumerate(sizes) for _ in range(n)]
    for lo in range(offset + 1):
        for hi in range(lo, offset + 2):
            want: dict[int, list[int]] = {}
            for byte in range(lo, min(hi, offset)):
                want.setdefault(owner[byte], []).append(byte)
            got = _overlaps(starts, segments, lo, hi)
            assert [(k, a, b) for k, a, b in got] == [(k, v[0], v[-1] + 1) for k, v in sorted(want.items())]


class _CudaLike:
    """Stands in for a CUDA tensor where only the dispatch is under test (no GPU here)."""

    class device:
        type = "cuda"


@pytest.mark.parametrize("env,refused,want", [(None, False, ["dma"]), ("0", False, ["buffered"]),
                                              ("1", False, ["dma"]), (None, True, ["dma", "buffered"])])
def test_cuda_targets_take_dma_unless_told_not_to_and_fall_back_when_refused(
        monkeypatch: pytest.MonkeyPatch, env: str | None, refused: bool, want: list[str]) -> None:
    from vsnap.engine.adapters.vllm.weights import copiers as weights_copy

    calls: list[str] = []

    def dma(*_: object, **__: object) -> dict[str, float]:
        calls.append("dma")
        if refused:
            raise weights_copy.RegistrationRefused("cuMemHostRegister: CUDA_ERROR_NOT_SUPPORTED")
        return {"weights_registered_pieces": 1.0}

    def buffered(*_: object, **__: object) -> dict[str, float]:
        calls.append("buffered")
        return {}

    monkeypatch.setattr(weights_copy, "dma_into", dma)
    monkeypatch.setattr(weights_copy, "buffered_into", buffered)
    if env is None:
        monkeypatch.delenv(weights_copy.DMA_ENV, raising=False)
    else:
        monkeypatch.setenv(weights_copy.DMA_ENV, env)
    with pytest.warns(UserWarning, match="copying through pinned buffers") if refused else contextlib.nullcontext():
        weights_copy.stream_into(Path("/nonexistent"), [], [_CudaLike()])
    assert calls == want
