"""The CUDA checkpoint module's pure parts (the driver calls run on the GPU machine)."""

from pathlib import Path

import pytest


def test_gpu_pair_candidates_try_a_full_permutation_first(monkeypatch: pytest.MonkeyPatch) -> None:
    from vsnap.host import cuda as _cuda

    gpus = [{"uuid": f"GPU-{i}", "index": i} for i in range(3)]
    monkeypatch.setattr(_cuda, "gpu_facts", lambda: ("580", "13.0", gpus))
    assert _cuda.gpu_pair_candidates([("GPU-0", "GPU-1")]) == [
        [("GPU-0", "GPU-1"), ("GPU-1", "GPU-0"), ("GPU-2", "GPU-2")],
        [("GPU-0", "GPU-1")],
    ]


@pytest.mark.parametrize("pairs,expected", [
    ([("A", "B")], [("A", "B"), ("B", "A"), ("C", "C"), ("D", "D")]),
    # two pairs (a TP=2 tree onto another pair): each GPU taken exactly once
    ([("A", "C"), ("B", "D")], [("A", "C"), ("B", "D"), ("C", "A"), ("D", "B")]),
    ([("A", "B"), ("B", "C")], [("A", "B"), ("B", "C"), ("C", "A"), ("D", "D")]),
    ([("A", "A"), ("B", "C")], [("A", "A"), ("B", "C"), ("C", "B"), ("D", "D")]),
    ([("A", "B"), ("C", "B")], []),  # two onto one: not a permutation
    ([("A", "E")], []),  # a GPU this host lacks
])
def test_complete_permutation_maps_every_gpu_once(pairs: list, expected: list) -> None:
    from vsnap.host import cuda as _cuda

    got = _cuda.complete_permutation(pairs, ["A", "B", "C", "D"])
    assert got == expected
    if got:
        assert sorted(new for _, new in got) == ["A", "B", "C", "D"]


def test_uuid_round_trip() -> None:
    from vsnap.host import cuda as _cuda

    class Raw:
        bytes = bytes(range(16))

    text = _cuda._format_uuid(Raw())
    assert text == "GPU-00010203-0405-0607-0809-0a0b0c0d0e0f"
    assert _cuda._uuid_bytes(text) == bytes(range(16))


def U(c: str) -> str:
    """A GPU UUID as the driver reports it, all of hex digit ``c``."""
    return f"GPU-{c * 8}-{c * 4}-{c * 4}-{c * 4}-{c * 12}"


def _manifest_with_gpu(need: int, tp: int = 1, uuids: list[str] | None = None):
    from tests.unit import fake_image

    gpus = [{"index": i, "name": "NVIDIA H200", "uuid": u, "memory_bytes": 100} for i, u in enumerate(uuids or [U("a")])]
    return fake_image.manifest(host=fake_image.host_facts(gpus=gpus), engine="vllm", cuda_processes=tp + 1,
                               gpu_memory_required=need, tensor_parallel_size=tp,
                               gpu_uuids=list(uuids) if uuids else [])


def test_choose_gpus_for_one_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    from vsnap.host import cuda as _cuda
    from vsnap.ops import gpus as _gpus
    from vsnap.protocol.errors import HostNotReady

    gpus = [{"index": 0, "name": "NVIDIA H200", "uuid": U("a")}, {"index": 1, "name": "NVIDIA H200", "uuid": U("b")},
            {"index": 2, "name": "NVIDIA H100", "uuid": U("c")}]
    free = {U("a"): 10, U("b"): 90, U("c"): 90}
    monkeypatch.setattr(_cuda, "gpu_facts", lambda: ("580", "13.0", gpus))
    monkeypatch.setattr(_cuda, "gpu_free_memory", lambda: free)
    manifest = _manifest_with_gpu(50)
    # the captured GPU is busy: the first other GPU of the same model with room
    assert _gpus.choose_gpus(manifest, None)[0].uuid == U("b")
    assert _gpus.choose_gpus(manifest, U("b"))[0].index == 1
    with pytest.raises(HostNotReady, match="GPU 2 is a NVIDIA H100; the image was captured on a NVIDIA H200"):
        _gpus.choose_gpus(manifest, "2")
    with pytest.raises(HostNotReady, match="GPU 0 has 0.0 GiB free"):
        _gpus.choose_gpus(manifest, "0")
    with pytest.raises(HostNotReady, match="no GPU '7' on this host"):
        _gpus.choose_gpus(manifest, "7")
    free[U("b")] = 10
    with pytest.raises(HostNotReady, match="no GPU can take this image"):
        _gpus.choose_gpus(manifest, None)
    free[U("a")] = 60
    assert _gpus.choose_gpus(manifest, None)[0].uuid == U("a")  # the captured one first


def test_the_gpus_facts_are_read_once_for_the_host_check_and_the_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    from concurrent.futures import Future

    from vsnap.host import cuda as _cuda
    from vsnap.image import compat
    from vsnap.ops import gpus as _gpus

    def driver_asked_again() -> None:
        raise AssertionError("gpu_facts called although its future was given")

    monkeypatch.setattr(_cuda, "gpu_facts", driver_asked_again)
    monkeypatch.setattr(_cuda, "gpu_free_memory", lambda: {U("a"): 90})
    read: Future = Future()
    read.set_result(("580.1", "13.0", [{"index": 0, "name": "NVIDIA H200", "uuid": U("a"), "memory_bytes": 100}]))
    manifest = _manifest_with_gpu(50)
    assert _gpus.choose_gpus(manifest, None, read)[0].uuid == U("a")
    facts = compat.current_facts(manifest, read)
    assert (facts.driver, facts.cuda, [g["uuid"] for g in facts.gpus]) == ("580.1", "13.0", [U("a")])


class FakeDriver:
    """The driver's checkpoint calls over an in-memory state per pid; restore waits until every
    process is being restored at once (or times out), which only the parallel path achieves."""

    class CUresult:
        CUDA_SUCCESS = 0
        CUDA_ERROR_INVALID_VALUE = 1

    def __init__(self, pids: list[int], fail: int | None = None) -> None:
        import threading

        self.states = {pid: "RUNNING" for pid in pids}
        self.fail = fail
        self.all_restoring = threading.Barrier(len(pids), timeout=5)
        self.calls: list[tuple[str, int]] = []

    def _state(self, name: str):
        from types import SimpleNamespace

        return SimpleNamespace(name=f"CU_PROCESS_STATE_{name}")

    def cuCheckpointProcessGetState(self, pid: int):
        if pid not in self.states:
            return (self.CUresult.CUDA_ERROR_INVALID_VALUE, None)
        return (self.CUresult.CUDA_SUCCESS, self._state(self.states[pid]))

    def _move(self, name: str, pid: int, want: str, to: str) -> tuple[int]:
        self.calls.append((name, pid))
        if self.states[pid] != want:
            return (self.CUresult.CUDA_ERROR_INVALID_VALUE,)
        self.states[pid] = to
        return (self.CUresult.CUDA_SUCCESS,)

    def cuCheckpointProcessLock(self, pid: int, args) -> tuple[int]:
        return self._move("lock", pid, "RUNNING", "LOCKED")

    def cuCheckpointProcessCheckpoint(self, pid: int, args) -> tuple[int]:
        return self._move("checkpoint", pid, "LOCKED", "CHECKPOINTED")

    def cuCheckpointProcessRestore(self, pid: int, args) -> tuple[int]:
        self.all_restoring.wait()
        if pid == self.fail:
            return (self.CUresult.CUDA_ERROR_INVALID_VALUE,)
        return self._move("restore", pid, "CHECKPOINTED", "LOCKED")

    def cuCheckpointProcessUnlock(self, pid: int, args) -> tuple[int]:
        return self._move("unlock", pid, "LOCKED", "RUNNING")

    def CUcheckpointLockArgs(self):
        from types import SimpleNamespace

        return SimpleNamespace(timeoutMs=0)


def test_checkpoint_then_restore_every_process_side_by_side() -> None:
    from vsnap.host.cuda import CudaCheckpoint

    driver = FakeDriver([11, 12, 13])
    cuda = CudaCheckpoint(driver=driver)
    assert cuda.cuda_pids([10, 11, 12, 13]) == [11, 12, 13]  # 10 has no CUDA context
    cuda.checkpoint([11, 12, 13])
    assert {cuda.state(pid) for pid in (11, 12, 13)} == {"checkpointed"}
    cuda.restore([11, 12, 13])  # the fake's barrier needs all three restores at the same time
    assert {cuda.state(pid) for pid in (11, 12, 13)} == {"running"}
    assert [c for c in driver.calls if c[0] == "unlock"] == [("unlock", 11), ("unlock", 12), ("unlock", 13)]


def test_a_failed_restore_names_the_process() -> None:
    from vsnap.host.cuda import CudaCheckpoint, CudaCheckpointError

    driver = FakeDriver([21, 22], fail=22)
    cuda = CudaCheckpoint(driver=driver)
    cuda.checkpoint([21, 22])
    with pytest.raises(CudaCheckpointError, match="cuCheckpointProcessRestore failed for pid 22"):
        cuda.restore([21, 22])


H200S = [{"index": i, "name": "NVIDIA H200", "uuid": U(c)} for i, c in enumerate("abcd")]


def test_choose_gpus_for_a_tensor_parallel_image(monkeypatch: pytest.MonkeyPatch) -> None:
    """One GPU per rank, in rank order: each rank on its captured GPU where it has room, the others
    on the first other GPUs that do; --gpu names one per rank, each once."""
    from vsnap.host import cuda as _cuda
    from vsnap.ops import gpus as _gpus
    from vsnap.protocol.errors import HostNotReady

    free = {U("a"): 90, U("b"): 90, U("c"): 90, U("d"): 90}
    monkeypatch.setattr(_cuda, "gpu_facts", lambda: ("580", "13.0", H200S))
    monkeypatch.setattr(_cuda, "gpu_free_memory", lambda: free)
    manifest = _manifest_with_gpu(50, tp=2, uuids=[U("b"), U("a")])  # rank 0 ran on GPU-b
    assert [g.uuid for g in _gpus.choose_gpus(manifest, None)] == [U("b"), U("a")]
    free[U("b")] = 10  # rank 0's GPU is busy: rank 1 keeps its own
    assert [g.uuid for g in _gpus.choose_gpus(manifest, None)] == [U("c"), U("a")]
    assert [g.uuid for g in _gpus.choose_gpus(manifest, "3,2")] == [U("d"), U("c")]
    assert [g.uuid for g in _gpus.choose_gpus(manifest, f"{U('c')}, 0")] == [U("c"), U("a")]
    with pytest.raises(HostNotReady, match=r"--gpu '2' names 1 GPU\(s\); the image has 2 rank\(s\)"):
        _gpus.choose_gpus(manifest, "2")
    with pytest.raises(HostNotReady, match="names GPU 2 twice"):
        _gpus.choose_gpus(manifest, f"2,{U('c')}")
    with pytest.raises(HostNotReady, match="GPU 1 has 0.0 GiB free"):
        _gpus.choose_gpus(manifest, "1,2")
    with pytest.raises(HostNotReady, match="has an empty entry"):
        _gpus.choose_gpus(manifest, "2,")
    free.update({U("c"): 10, U("d"): 10})
    with pytest.raises(HostNotReady, match="fewer than 2 GPUs can take this image: GPU 1 has"):
        _gpus.choose_gpus(manifest, None)
    monkeypatch.setattr(_cuda, "gpu_facts", lambda: ("580", "13.0", H200S[:1]))
    with pytest.raises(HostNotReady, match=r"this host has 1 GPU\(s\); the image needs 2"):
        _gpus.choose_gpus(_manifest_with_gpu(0, tp=2, uuids=[U("a"), U("b")]), None)


def test_gpu_pairs_map_each_rank_and_nothing_when_all_stay() -> None:
    from vsnap.ops import gpus as _gpus

    from vsnap.ops.gpus import Gpu

    a, b, c = (Gpu(index, "NVIDIA H200", uuid) for index, uuid in enumerate(("GPU-a", "GPU-b", "GPU-c")))
    assert _gpus.gpu_pairs(["GPU-a"], [a]) == []  # one rank on its own GPU: no map, as before
    assert _gpus.gpu_pairs(["GPU-a"], [b]) == [("GPU-a", "GPU-b")]
    assert _gpus.gpu_pairs(["GPU-a", "GPU-b"], [a, b]) == []
    assert _gpus.gpu_pairs(["GPU-a", "GPU-b"], [b, c]) == [("GPU-a", "GPU-b"), ("GPU-b", "GPU-c")]
    assert _gpus.gpu_pairs(["GPU-a", "GPU-b"], [a, c]) == [("GPU-a", "GPU-a"), ("GPU-b", "GPU-c")]
    assert _gpus.gpu_pairs([], None) == []


def test_a_manifest_without_the_tensor_parallel_fields_reads_as_one_rank(tmp_path) -> None:
    """Images captured before tensor parallelism: one rank, on the first recorded GPU."""
    import json

    from tests.unit import fake_image
    from vsnap.image.manifest import read_manifest

    gpus = [{"index": 0, "name": "NVIDIA H200", "uuid": U("a"), "memory_bytes": 100}]
    raw = json.loads(fake_image.manifest(host=fake_image.host_facts(gpus=gpus), cuda_processes=2).model_dump_json())
    del raw["tensor_parallel_size"], raw["gpu_uuids"]
    manifest = read_manifest(fake_image.make_image(tmp_path / "images" / "old", raw=raw))
    assert manifest.tensor_parallel_size == 1 and manifest.gpu_uuids == []
    assert manifest.captured_gpus() == [U("a")]
    assert fake_image.manifest(cuda_processes=0).captured_gpus() == []  # no CUDA state: no GPU


def test_a_manifest_needs_one_different_gpu_per_rank() -> None:
    from tests.unit import fake_image
    from vsnap.protocol.records import RecordError

    assert fake_image.manifest(tensor_parallel_size=2, gpu_uuids=[U("a"), U("b")]).captured_gpus() == [
        U("a"), U("b")]
    for uuids in ([U("a")], [U("a"), U("a")]):
        with pytest.raises(RecordError, match="gpu_uuids must name 2 different GPUs"):
            fake_image.manifest(tensor_parallel_size=2, gpu_uuids=uuids)
    with pytest.raises(RecordError, match="tensor_parallel_size: Input should be greater than or equal to 1"):
        fake_image.manifest(tensor_parallel_size=0)


def test_a_crafted_manifest_names_real_gpus_for_its_ranks_or_is_refused_at_read(tmp_path) -> None:
    """What the CUDA restore's GPU map is built from must be GPU UUIDs, one per rank: otherwise the
    restore crashed after CRIU (ValueError parsing the UUID), a missing host.gpus uuid crashed the
    GPU choice (KeyError), a rank without a recorded GPU was mapped nowhere (onto whatever GPU it
    ran on, not the one vsnap chose and checked), and a bool or string read as a size."""
    import json

    from tests.unit import fake_image
    from vsnap.image.manifest import read_manifest
    from vsnap.protocol.errors import ImageFormatError

    gpus = [{"index": 0, "name": "NVIDIA H200", "uuid": U("a"), "memory_bytes": 100}]
    base = json.loads(fake_image.manifest(host=fake_image.host_facts(gpus=gpus), engine="vllm",
                                          cuda_processes=2).model_dump_json())
    crafted = {
        "not-a-uuid": ({"gpu_uuids": ["GPU-zz"]}, "must be GPU UUIDs"),
        "control": ({"gpu_uuids": ["GPU-\x1b[2J\n" + "a" * 10000]}, "must be GPU UUIDs"),
        "empty": ({"gpu_uuids": [""]}, "must be GPU UUIDs"),
        "no-host-uuid": ({"host": {**base["host"], "gpus": [{"name": "NVIDIA H200"}]}}, "must be GPU UUIDs"),
        "no-host-gpu": ({"host": {**base["host"], "gpus": []}}, "must name the GPU of each"),
        "tp2-no-uuids": ({"tensor_parallel_size": 2}, "must name the GPU of each"),
        "bool": ({"tensor_parallel_size": True}, "tensor_parallel_size: Input should be a valid integer"),
        "string": ({"tensor_parallel_size": "2", "gpu_uuids": [U("a"), U("b")]}, "tensor_parallel_size: Input"),
    }
    for name, (fields, message) in crafted.items():
        image = fake_image.make_image(tmp_path / "images" / name, raw={**base, **fields})
        with pytest.raises(ImageFormatError, match=message) as info:
            read_manifest(image)
        assert "\n" not in info.value.message and len(info.value.message) < 400, name
    assert read_manifest(fake_image.make_image(tmp_path / "images" / "ok", raw=base)).captured_gpus() == [U("a")]
    no_cuda = {**base, "cuda_processes": 0, "host": {**base["host"], "gpus": []}}
    assert read_manifest(fake_image.make_image(tmp_path / "images" / "cpu", raw=no_cuda)).captured_gpus() == []


def test_gpu_lists_with_an_empty_entry_or_of_any_length_are_refused_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """--gpu 0,,1 for two ranks was refused as 'names 2 GPU(s); the image has 2 rank(s)' (the cause,
    the empty entry, unnamed), and every refusal echoed the argument whole: a newline in it split
    the error over lines, a long list made a line of any length."""
    from vsnap.host import cuda as _cuda
    from vsnap.ops import gpus as _gpus
    from vsnap.protocol.errors import HostNotReady

    monkeypatch.setattr(_cuda, "gpu_facts", lambda: ("580", "13.0", H200S))
    monkeypatch.setattr(_cuda, "gpu_free_memory", lambda: {g["uuid"]: 90 for g in H200S})
    manifest = _manifest_with_gpu(50, tp=2, uuids=[U("a"), U("b")])
    for requested in ("0,,1", "0,1,", ",", " "):
        with pytest.raises(HostNotReady, match="has an empty entry") as info:
            _gpus.choose_gpus(manifest, requested)
        assert "--gpu 0,1" in info.value.hint
    for requested in ("0\n,1,2", ",".join(["0"] * 5000), "\n0", "x" * 5000 + ",1"):
        with pytest.raises(HostNotReady) as info:
            _gpus.choose_gpus(manifest, requested)
        assert "\n" not in info.value.message and len(info.value.message) < 300, info.value.message
    assert [g.index for g in _gpus.choose_gpus(manifest, " 1 , 0 ")] == [1, 0]


def test_a_standby_with_gpu_is_refused_in_one_line_however_long_the_gpu_argument() -> None:
    """The standby refusal echoed --gpu whole (a newline split it, 5000 characters made one line of
    that length); it is refused before any check of the host, so this runs unprivileged."""
    from vsnap.ops import restore as _restore
    from vsnap.protocol.errors import UnsupportedOption

    for requested in ("0", "0\n1", "x" * 5000):
        with pytest.raises(UnsupportedOption, match="a standby holds no GPU") as info:
            _restore.restore_image(Path("/nonexistent"), gpu=requested, standby=True)
        assert "\n" not in info.value.message and len(info.value.message) < 200, info.value.message


def test_the_driver_starts_early_once_and_keeps_its_failure(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    from vsnap.host import cuda as _cuda
    from vsnap.host import gpu_early as _gpu_early
    from vsnap.protocol.errors import HostNotReady

    monkeypatch.setattr(_gpu_early, "_facts", None)
    monkeypatch.setattr(_gpu_early, "NVIDIA_CONTROL", str(tmp_path / "absent"))
    _gpu_early.start()
    assert _gpu_early._facts is None  # no NVIDIA driver: nothing started

    control = tmp_path / "nvidiactl"
    control.touch()
    monkeypatch.setattr(_gpu_early, "NVIDIA_CONTROL", str(control))
    calls = []
    monkeypatch.setattr(_cuda, "gpu_facts", lambda: calls.append(1) or ("580", "13.0", []))
    _gpu_early.start()
    _gpu_early.start()  # once per process
    assert _gpu_early._facts is not None and _gpu_early._facts.result(timeout=10) == ("580", "13.0", [])
    assert _gpu_early.gpu_facts() == ("580", "13.0", []) and calls == [1]  # the verify phase takes them

    def no_bindings() -> None:
        raise HostNotReady("cuda", "cuda-bindings is not installed")

    monkeypatch.setattr(_gpu_early, "_facts", None)
    monkeypatch.setattr(_cuda, "gpu_facts", no_bindings)
    _gpu_early.start()
    with pytest.raises(HostNotReady, match="cuda-bindings"):  # raised where the facts are needed, not before
        _gpu_early.gpu_facts()
