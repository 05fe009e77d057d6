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


def _manifest_with_gpu(need: int):
    from types import SimpleNamespace

    host = SimpleNamespace(gpus=[{"index": 0, "name": "NVIDIA H200", "uuid": "GPU-a", "memory_bytes": 100}])
    return SimpleNamespace(host=host, gpu_memory_required=need)


def test_choose_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from vsnap import _cuda, _restore
    from vsnap._errors import HostNotReady

    gpus = [{"index": 0, "name": "NVIDIA H200", "uuid": "GPU-a"}, {"index": 1, "name": "NVIDIA H200", "uuid": "GPU-b"},
            {"index": 2, "name": "NVIDIA H100", "uuid": "GPU-c"}]
    free = {"GPU-a": 10, "GPU-b": 90, "GPU-c": 90}
    monkeypatch.setattr(_cuda, "gpu_facts", lambda: ("580", "13.0", gpus))
    monkeypatch.setattr(_cuda, "gpu_free_memory", lambda: free)
    manifest = _manifest_with_gpu(50)
    # the captured GPU is busy: the first other GPU of the same model with room
    assert _restore.choose_gpu(manifest, None)["uuid"] == "GPU-b"
    assert _restore.choose_gpu(manifest, "GPU-b")["index"] == 1
    with pytest.raises(HostNotReady, match="GPU 2 is a NVIDIA H100; the image was captured on a NVIDIA H200"):
        _restore.choose_gpu(manifest, "2")
    with pytest.raises(HostNotReady, match="GPU 0 has 0.0 GiB free"):
        _restore.choose_gpu(manifest, "0")
    with pytest.raises(HostNotReady, match="no GPU 7 on this host"):
        _restore.choose_gpu(manifest, "7")
    free["GPU-b"] = 10
    with pytest.raises(HostNotReady, match="no GPU can take this image"):
        _restore.choose_gpu(manifest, None)
    free["GPU-a"] = 60
    assert _restore.choose_gpu(manifest, None)["uuid"] == "GPU-a"  # the captured one first
