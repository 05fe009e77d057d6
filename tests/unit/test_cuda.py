"""The CUDA checkpoint module's pure parts (the driver calls run on the GPU machine)."""

import pytest


def test_gpu_pair_candidates_try_a_full_permutation_first(monkeypatch: pytest.MonkeyPatch) -> None:
    from vsnap import _cuda

    gpus = [{"uuid": f"GPU-{i}", "index": i} for i in range(3)]
    monkeypatch.setattr(_cuda, "gpu_facts", lambda: ("580", "13.0", gpus))
    assert _cuda.gpu_pair_candidates([("GPU-0", "GPU-1")]) == [
        [("GPU-0", "GPU-1"), ("GPU-1", "GPU-0"), ("GPU-2", "GPU-2")],
        [("GPU-0", "GPU-1")],
    ]


def test_uuid_round_trip() -> None:
    from vsnap import _cuda

    class Raw:
        bytes = bytes(range(16))

    text = _cuda._format_uuid(Raw())
    assert text == "GPU-00010203-0405-0607-0809-0a0b0c0d0e0f"
    assert _cuda._uuid_bytes(text) == bytes(range(16))
