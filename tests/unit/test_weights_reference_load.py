"""Weights by reference through the worker's methods with CPU tensors: save (only the literal
bytes written, the plan kept and written as JSON), load (every byte back), refresh (a changed
reference becomes literal), and the adapter's switch."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

np = pytest.importorskip("numpy")
torch = pytest.importorskip("torch")

from tests.unit.test_weights_reference import KIB, checkpoint  # noqa: E402, F401 (a fixture)
from vsnap.engine.adapters.vllm.weights import extension as weights_extension  # noqa: E402
from vsnap.engine.adapters.vllm.weights.layout import layout, storage_view  # noqa: E402
from vsnap.engine.adapters.vllm.weights.reference_copiers import stream_plan_into  # noqa: E402
from vsnap.engine.adapters.vllm.weights.references import IMAGE, Plan, write_by_reference  # noqa: E402


def _worker(monkeypatch: pytest.MonkeyPatch, named: list[tuple[str, Any]]) -> weights_extension.WeightsFileExtension:
    monkeypatch.setattr(weights_extension, "pool_tensors", lambda model: named)
    worker = weights_extension.WeightsFileExtension.__new__(weights_extension.WeightsFileExtension)
    worker._vsnap_model = lambda: torch.nn.Module()  # type: ignore[method-assign]
    return worker


def _pool(c: dict[str, Any]) -> list[tuple[str, Any]]:
    """Views over CPU tensors as pool_tensors gives them: a fused qkv, a norm, an FP8-like tensor, embed."""
    tensors = [torch.from_numpy(np.concatenate([c["q"], c["k"], c["v"]])).view(torch.bfloat16),
               torch.from_numpy(c["norm"].copy()).view(torch.float32),
               torch.from_numpy((c["gate"] ^ 0x55).astype(np.uint8)),
               torch.from_numpy(c["embed"].copy()).view(torch.int16)]
    return [(name, storage_view(t)) for name, t in zip(["qkv", "norm", "fp8", "embed"], tensors)]


def _load(worker: weights_extension.WeightsFileExtension, directory: Path) -> dict[str, float]:
    worker.vsnap_start_loading_weights(str(directory))
    return worker.vsnap_finish_loading_weights()


def test_save_by_reference_writes_only_the_literal_bytes_and_the_load_brings_every_byte_back(
        monkeypatch: pytest.MonkeyPatch, checkpoint: dict[str, Any], tmp_path: Path) -> None:
    named = _pool(checkpoint)
    want = [t.clone() for _, t in named]
    worker = _worker(monkeypatch, named)
    weights = tmp_path / "weights"
    report = worker.vsnap_save_weights(str(weights), str(checkpoint["dir"]))
    literal = 8 * KIB + 96 * KIB
    assert report["literal_bytes"] == literal == report["weights_bytes"] == (weights / "rank0.bin").stat().st_size
    assert report["referenced_bytes"] == 256 * KIB + 300_000 and report["reference_extents"] == 4
    assert (weights / "rank0.bin").read_bytes() == want[1].numpy().tobytes() + want[2].numpy().tobytes()
    assert Plan.from_json((weights / "rank0.refs.json").read_text()) == worker._vsnap_plan
    for _, t in named:
        t.zero_()
    result = _load(worker, weights)
    assert result["weights_bytes"] == sum(t.numel() for t in want)
    assert result["weights_referenced_bytes"] == report["referenced_bytes"]
    for (name, got), expected in zip(named, want):
        assert torch.equal(got, expected), name


def test_the_default_save_is_the_plain_file(monkeypatch: pytest.MonkeyPatch, checkpoint: dict[str, Any],
                                            tmp_path: Path) -> None:
    named = _pool(checkpoint)
    worker = _worker(monkeypatch, named)
    report = worker.vsnap_save_weights(str(tmp_path / "w"))
    assert worker._vsnap_plan is None and "referenced_bytes" not in report
    assert sorted(os.listdir(tmp_path / "w")) == ["rank0.bin"]
    assert (tmp_path / "w" / "rank0.bin").read_bytes() == b"".join(t.numpy().tobytes() for _, t in named)


def test_refresh_makes_a_changed_reference_literal_and_rewrites_literal_bytes_in_place(
        monkeypatch: pytest.MonkeyPatch, checkpoint: dict[str, Any], tmp_path: Path) -> None:
    named = _pool(checkpoint)
    worker = _worker(monkeypatch, named)
    weights = tmp_path / "weights"
    worker.vsnap_save_weights(str(weights), str(checkpoint["dir"]))
    size = (weights / "rank0.bin").stat().st_size
    assert worker.vsnap_refresh_weights(str(weights))["refreshed_tensors"] == 0
    named[2][1][:10] = 7  # a literal tensor: rewritten in place
    result = worker.vsnap_refresh_weights(str(weights))
    assert result["refreshed_tensors"] == 1 and result["references_made_literal"] == 0
    assert (weights / "rank0.bin").stat().st_size == size
    named[0][1][128 * KIB + 5] ^= 0xFF  # inside k's reference: k becomes literal, q and v stay references
    result = worker.vsnap_refresh_weights(str(weights))
    assert result["refreshed_tensors"] == 1 and result["references_made_literal"] == 1
    plan = worker._vsnap_plan
    assert (weights / "rank0.bin").stat().st_size == size + 64 * KIB == plan.literal_bytes
    assert Plan.from_json((weights / "rank0.refs.json").read_text()) == plan
    assert [e.source == IMAGE for e in plan.extents[:3]] == [False, True, False]
    want = [t.clone() for _, t in named]
    for _, t in named:
        t.zero_()
    _load(worker, weights)
    for (name, got), expected in zip(named, want):
        assert torch.equal(got, expected), name


@pytest.mark.parametrize("chunk,threads", [(64 * KIB, 3), (7, 2), (1 << 20, 8)])
def test_stream_plan_into_cpu_tensors_every_byte(checkpoint: dict[str, Any], tmp_path: Path, chunk: int,
                                                 threads: int) -> None:
    named = _pool(checkpoint)
    rank_path = tmp_path / "rank0.bin"
    with open(rank_path, "wb") as f:
        plan = write_by_reference(f, (t.numpy() for _, t in named), str(checkpoint["dir"]))
    empty = [torch.zeros_like(t) for _, t in named]
    stream_plan_into(plan, rank_path, layout(named), empty, threads=threads, chunk=chunk)
    for (name, want), got in zip(named, empty):
        assert torch.equal(want, got), name


def test_a_model_file_of_another_size_or_a_short_rank_file_is_refused(checkpoint: dict[str, Any],
                                                                      tmp_path: Path) -> None:
    named = _pool(checkpoint)
    rank_path = tmp_path / "rank0.bin"
    with open(rank_path, "wb") as f:
        plan = write_by_reference(f, (t.numpy() for _, t in named), str(checkpoint["dir"]))
    targets = [torch.zeros_like(t) for _, t in named]
    with open(plan.model_path(0), "ab") as f:
        f.write(b"x")
    with pytest.raises(ValueError, match="changed since the capture"):
        stream_plan_into(plan, rank_path, layout(named), targets)
    with open(rank_path, "ab") as f:
        f.write(b"x")
    with pytest.raises(ValueError, match=f"the weights plan needs {plan.literal_bytes}"):
        stream_plan_into(plan, rank_path, layout(named), targets)
    with pytest.raises(ValueError, match="the parameters need"):
        stream_plan_into(plan, rank_path, layout(named[:-1]), targets[:-1])


def test_the_adapter_passes_the_model_directory_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from vsnap.engine.adapters.vllm import adapter as vllm_adapter

    adapter = vllm_adapter.VllmAdapter.__new__(vllm_adapter.VllmAdapter)
    adapter.launch = SimpleNamespace(model="/models/llama")
    monkeypatch.delenv(weights_extension.BY_REFERENCE_ENV, raising=False)
    assert adapter._save_weights_args("/img/weights") == ("/img/weights",)  # the default: as before
    monkeypatch.setenv(weights_extension.BY_REFERENCE_ENV, "0")
    assert adapter._save_weights_args("/img/weights") == ("/img/weights",)
    monkeypatch.setenv(weights_extension.BY_REFERENCE_ENV, "1")
    assert adapter._save_weights_args("/img/weights") == ("/img/weights", "/models/llama")


class _CudaLike:
    """Stands in for a CUDA tensor where only the dispatch is under test (no GPU here)."""

    class device:
        type = "cuda"


@pytest.mark.parametrize("env,refused,want", [(None, False, ["dma"]), ("0", False, ["buffered"]),
                                              (None, True, ["dma", "buffered"])])
def test_cuda_targets_take_dma_unless_told_not_to_and_fall_back_when_refused(
        monkeypatch: pytest.MonkeyPatch, env: str | None, refused: bool, want: list[str]) -> None:
    import contextlib

    from vsnap.engine.adapters.vllm.weights import reference_copiers
    from vsnap.engine.adapters.vllm.weights.copiers import DMA_ENV, RegistrationRefused

    calls: list[str] = []

    def dma(*_: object, **__: object) -> dict[str, float]:
        calls.append("dma")
        if refused:
            raise RegistrationRefused("cuMemHostRegister: CUDA_ERROR_NOT_SUPPORTED")
        return {}

    def buffered(*_: object, **__: object) -> dict[str, float]:
        calls.append("buffered")
        return {}

    monkeypatch.setattr(reference_copiers, "dma_plan_into", dma)
    monkeypatch.setattr(reference_copiers, "buffered_plan_into", buffered)
    if env is None:
        monkeypatch.delenv(DMA_ENV, raising=False)
    else:
        monkeypatch.setenv(DMA_ENV, env)
    with pytest.warns(UserWarning, match="copying through pinned buffers") if refused else contextlib.nullcontext():
        result = stream_plan_into(Plan("/m", (), ()), Path("/nonexistent"), [], [_CudaLike()])
    assert calls == want and result.get("weights_dma_refused") == (1.0 if refused else None)


def test_a_fifo_in_a_model_files_place_is_refused_not_waited_on(checkpoint: dict[str, Any], tmp_path: Path) -> None:
    """The restore's load opened the model's files blocking: a FIFO put there (after the dependency
    check) hung the worker's load until the recover deadline. Hostile pass h1."""
    import signal

    named = _pool(checkpoint)
    rank_path = tmp_path / "rank0.bin"
    with open(rank_path, "wb") as f:
        plan = write_by_reference(f, (t.numpy() for _, t in named), str(checkpoint["dir"]))
    targets = [torch.zeros_like(t) for _, t in named]
    os.unlink(plan.model_path(0))
    os.mkfifo(plan.model_path(0))

    class Blocked(Exception):
        pass

    def alarm(*_: object) -> None:
        raise Blocked("the load blocked for 5 s")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(5)
    try:
        with pytest.raises(ValueError, match="is not a regular file; the image's weights plan reads a file there"):
            stream_plan_into(plan, rank_path, layout(named), targets, threads=1)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
