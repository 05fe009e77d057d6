"""dma_into's bookkeeping against a stand-in for the CUDA driver (no GPU here): which pieces are
page-locked when, that every byte lands, that a refusal or a failed copy leaves nothing locked and
the file unmapped. tests/gpu/test_weights_dma.py runs the real driver on the GPU machine."""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import types
from pathlib import Path
from typing import Any

import pytest

np = pytest.importorskip("numpy")

from vsnap.engine.adapters.vllm.weights import copiers  # noqa: E402
from vsnap.engine.adapters.vllm.weights import extension as weights_extension  # noqa: E402
from vsnap.engine.adapters.vllm.weights.copiers import RegistrationRefused, dma_into  # noqa: E402
from vsnap.engine.adapters.vllm.weights.layout import Segment  # noqa: E402

PAGE = os.sysconf("SC_PAGE_SIZE")


class FakeDriver(types.ModuleType):
    """The calls dma_into makes, with copies done at once by memmove; ``refuse_at`` (the n-th
    registration, from 1) and ``fail_copy_at`` make one fail."""

    class CUresult:
        CUDA_SUCCESS = 0
        CUDA_ERROR_NOT_SUPPORTED = 801
        CUDA_ERROR_ILLEGAL_ADDRESS = 700

    class CUstream_flags:
        CU_STREAM_NON_BLOCKING = 1

    class CUevent_flags:
        CU_EVENT_DISABLE_TIMING = 2

    CU_MEMHOSTREGISTER_READ_ONLY = 8

    def __init__(self, refuse_at: int | None = None, fail_copy_at: int | None = None) -> None:
        super().__init__("cuda.bindings.driver")
        self.lock = threading.Lock()
        self.locked: dict[int, int] = {}
        self.peak = self.registrations = self.copies = 0
        self.refuse_at, self.fail_copy_at = refuse_at, fail_copy_at
        self.contexts = 0
        self.unlocks = 0
        self.unlocks_at_failure: int | None = None  # how many pieces had been unlocked when one call failed
        self.refuse_unlock: set[int] = set()  # addresses cuMemHostUnregister refuses

    def cuDeviceGet(self, ordinal: int) -> tuple[int, int]:
        return 0, ordinal

    def cuDevicePrimaryCtxRetain(self, device: int) -> tuple[int, str]:
        with self.lock:
            self.contexts += 1
        return 0, f"ctx{device}"

    def cuDevicePrimaryCtxRelease(self, device: int) -> tuple[int]:
        with self.lock:
            self.contexts -= 1
        return (0,)

    def cuCtxSetCurrent(self, context: str) -> tuple[int]:
        return (0,)

    def cuStreamCreate(self, flags: int) -> tuple[int, object]:
        return 0, object()

    def cuStreamSynchronize(self, stream: object) -> tuple[int]:
        return (0,)

    def cuStreamDestroy(self, stream: object) -> tuple[int]:
        return (0,)

    def cuEventCreate(self, flags: int) -> tuple[int, object]:
        return 0, object()

    def cuEventRecord(self, event: object, stream: object) -> tuple[int]:
        return (0,)

    def cuEventSynchronize(self, event: object) -> tuple[int]:
        return (0,)

    def cuEventDestroy(self, event: object) -> tuple[int]:
        return (0,)

    def cuMemHostRegister(self, address: int, size: int, flags: int) -> tuple[int]:
        assert flags == self.CU_MEMHOSTREGISTER_READ_ONLY and address % PAGE == 0
        with self.lock:
            self.registrations += 1
            if self.registrations == self.refuse_at:
                self.unlocks_at_failure = self.unlocks
                return (self.CUresult.CUDA_ERROR_NOT_SUPPORTED,)
            assert all(address + size <= a or a + n <= address for a, n in self.locked.items()), "overlap"
            self.locked[address] = size
            self.peak = max(self.peak, len(self.locked))
        return (0,)

    def cuMemHostUnregister(self, address: int) -> tuple[int]:
        with self.lock:
            if address in self.refuse_unlock:
                return (self.CUresult.CUDA_ERROR_NOT_SUPPORTED,)
            del self.locked[address]
            self.unlocks += 1
        return (0,)

    def cuMemcpyHtoDAsync(self, dst: int, src: int, size: int, stream: object) -> tuple[int]:
        with self.lock:
            self.copies += 1
            if self.copies == self.fail_copy_at:
                self.unlocks_at_failure = self.unlocks
                return (self.CUresult.CUDA_ERROR_ILLEGAL_ADDRESS,)
            assert any(a <= src and src + size <= a + n for a, n in self.locked.items()), "copy from unlocked memory"
        ctypes.memmove(dst, src, size)
        return (0,)


class FakeTarget:
    """A flat uint8 'CUDA tensor' in host memory."""

    class device:
        type = "cuda"
        index = 0

    def __init__(self, n: int) -> None:
        self.array = np.zeros(max(n, 1), dtype=np.uint8)
        self.n = n

    def data_ptr(self) -> int:
        return int(self.array.ctypes.data)

    def bytes(self) -> bytes:
        return self.array[:self.n].tobytes()


def _layout(sizes: list[int]) -> list[Segment]:
    segments, offset = [], 0
    for k, n in enumerate(sizes):
        segments.append(Segment(f"s{k}", offset, n, "torch.uint8", (n,)))
        offset += n
    return segments


@pytest.fixture
def weights(tmp_path: Path) -> tuple[Path, list[int], bytes]:
    sizes = [1, 5 * PAGE + 13, PAGE, 0, 7 * PAGE - 1, 777, 3 * PAGE]
    data = os.urandom(sum(sizes))
    path = tmp_path / "rank0.bin"
    path.write_bytes(data)
    return path, sizes, data


def _install(monkeypatch: pytest.MonkeyPatch, driver: FakeDriver) -> None:
    bindings = types.ModuleType("cuda.bindings")
    bindings.driver = driver  # type: ignore[attr-defined]
    cuda = types.ModuleType("cuda")
    cuda.bindings = bindings  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "cuda", cuda)
    monkeypatch.setitem(sys.modules, "cuda.bindings", bindings)
    monkeypatch.setitem(sys.modules, "cuda.bindings.driver", driver)


def _mapped(path: Path) -> bool:
    return str(path) in Path("/proc/self/maps").read_text()


@pytest.mark.parametrize("piece_pages,threads,held", [(1, 3, 2), (3, 2, 2), (4, 4, 2), (64, 1, 2), (1, 2, 3), (1, 1, 16)])
def test_every_byte_lands_with_at_most_held_pieces_locked_per_thread(
        monkeypatch: pytest.MonkeyPatch, weights: tuple[Path, list[int], bytes], piece_pages: int, threads: int,
        held: int) -> None:
    path, sizes, data = weights
    driver = FakeDriver()
    _install(monkeypatch, driver)
    targets = [FakeTarget(n) for n in sizes]
    result = dma_into(path, _layout(sizes), targets, threads=threads, piece=piece_pages * PAGE, held=held)
    pieces = -(-len(data) // (piece_pages * PAGE))
    assert result["weights_registered_pieces"] == pieces == driver.registrations
    assert b"".join(t.bytes() for t in targets) == data
    assert driver.peak <= held * min(threads, pieces)
    if threads == 1:  # one thread reaches its limit: exactly that many are locked at the peak
        assert driver.peak == min(held, pieces)
    assert driver.locked == {} and driver.contexts == 0 and not _mapped(path)


def test_fewer_than_two_held_pieces_is_refused(weights: tuple[Path, list[int], bytes]) -> None:
    path, sizes, _ = weights
    with pytest.raises(ValueError, match="held must be at least 2"):
        dma_into(path, _layout(sizes), [FakeTarget(n) for n in sizes], held=1)


# (6, 2): five pieces were locked before, so one thread had unlocked its oldest; with 16 held no thread ever
# unlocks before the end (17 pieces)
@pytest.mark.parametrize("refuse_at,held", [(1, 2), (3, 2), (6, 2), (3, 16)])
def test_a_refused_lock_raises_registration_refused_with_nothing_left_locked(
        monkeypatch: pytest.MonkeyPatch, weights: tuple[Path, list[int], bytes], refuse_at: int, held: int) -> None:
    path, sizes, _ = weights
    driver = FakeDriver(refuse_at=refuse_at)
    _install(monkeypatch, driver)
    with pytest.raises(RegistrationRefused, match="cuMemHostRegister"):
        dma_into(path, _layout(sizes), [FakeTarget(n) for n in sizes], threads=2, piece=PAGE, held=held)
    assert driver.locked == {} and driver.contexts == 0 and not _mapped(path)
    if (refuse_at, held) == (6, 2):
        assert (driver.unlocks_at_failure or 0) > 0
    elif refuse_at == 1 or held == 16:
        assert driver.unlocks_at_failure == 0
    pieces = -(-sum(sizes) // PAGE)
    assert driver.registrations <= refuse_at + 2 < pieces  # the other thread stopped too, not after every piece


# (12, 2): at most 6 copies go beyond one per piece (segment boundaries), so 6 pieces were locked by two
# threads and one had unlocked its oldest; at the second copy no thread can have
@pytest.mark.parametrize("fail_copy_at,held", [(2, 2), (12, 2), (2, 16)])
def test_a_failed_copy_is_an_error_not_a_refusal(monkeypatch: pytest.MonkeyPatch,
                                                 weights: tuple[Path, list[int], bytes], fail_copy_at: int,
                                                 held: int) -> None:
    path, sizes, _ = weights
    driver = FakeDriver(fail_copy_at=fail_copy_at)
    _install(monkeypatch, driver)
    with pytest.raises(RuntimeError, match="to the GPU"):
        dma_into(path, _layout(sizes), [FakeTarget(n) for n in sizes], threads=2, piece=PAGE, held=held)
    assert driver.locked == {} and not _mapped(path)
    assert (driver.unlocks_at_failure or 0) > 0 if fail_copy_at == 12 else driver.unlocks_at_failure == 0


def test_without_cuda_bindings_or_a_mappable_file_it_is_refused(monkeypatch: pytest.MonkeyPatch,
                                                                 weights: tuple[Path, list[int], bytes]) -> None:
    path, sizes, _ = weights
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)  # import fails
    monkeypatch.setitem(sys.modules, "cuda", None)
    with pytest.raises(RegistrationRefused, match="no cuda-bindings"):
        dma_into(path, _layout(sizes), [FakeTarget(n) for n in sizes])
    _install(monkeypatch, FakeDriver())

    def no_mmap(*_: Any, **__: Any) -> Any:
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(copiers.mmap, "mmap", no_mmap)
    with pytest.raises(RegistrationRefused, match="cannot be mapped"):
        dma_into(path, _layout(sizes), [FakeTarget(n) for n in sizes])


def test_a_piece_that_is_not_whole_pages_is_refused(weights: tuple[Path, list[int], bytes]) -> None:
    path, sizes, _ = weights
    with pytest.raises(ValueError, match="multiple of the page size"):
        dma_into(path, _layout(sizes), [FakeTarget(n) for n in sizes], piece=PAGE + 100)


@pytest.mark.parametrize("available_kib,want", [(64 << 20, 16), (8 << 20, 2), (12 << 20, 3), (0, 2)])
def test_held_pieces_stay_within_half_of_the_available_memory(tmp_path: Path, available_kib: int, want: int) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal:       {128 << 20} kB\nMemAvailable:   {available_kib} kB\n")
    # 4 threads x 512 MiB: 64 GiB available allows 16 each, 12 GiB allows 3, 8 GiB the least (2)
    assert copiers.held_within_memory(16, 4, 512 << 20, meminfo) == want
    assert copiers.held_within_memory(16, 4, 512 << 20, tmp_path / "absent") == 2


@pytest.mark.parametrize("threads,held", [(2, 16), (3, 2)])
def test_unlock_later_keeps_the_last_pieces_locked_until_released(
        monkeypatch: pytest.MonkeyPatch, weights: tuple[Path, list[int], bytes], threads: int, held: int) -> None:
    path, sizes, data = weights
    driver = FakeDriver()
    _install(monkeypatch, driver)
    targets = [FakeTarget(n) for n in sizes]
    handed: list[copiers.LockedPages] = []
    result = dma_into(path, _layout(sizes), targets, threads=threads, piece=PAGE, held=held, unlock_later=handed.append)
    assert b"".join(t.bytes() for t in targets) == data
    pieces = -(-len(data) // PAGE)
    [pages] = handed
    # every piece no thread had to unlock to stay within `held` is still locked, and the file still mapped
    # how the pieces fell between the threads decides how many each still holds: at most `held`
    # each, and the busiest thread's last `held`
    assert len(driver.locked) == pages.pieces == result["weights_unlocked_later_pieces"]
    assert min(held, pieces) <= pages.pieces <= threads * held
    assert driver.unlocks == pieces - pages.pieces and _mapped(path)
    kept = pages.pieces
    assert pages.release(pause_s=0.001)["unlocked_pieces"] == kept
    assert driver.locked == {} and driver.unlocks == pieces and driver.contexts == 0 and not _mapped(path)
    assert pages.release() == {}  # once only


def test_unlock_later_is_not_called_when_a_copy_fails(monkeypatch: pytest.MonkeyPatch,
                                                      weights: tuple[Path, list[int], bytes]) -> None:
    path, sizes, _ = weights
    driver = FakeDriver(fail_copy_at=9)
    _install(monkeypatch, driver)
    handed: list[copiers.LockedPages] = []
    with pytest.raises(RuntimeError, match="to the GPU"):
        dma_into(path, _layout(sizes), [FakeTarget(n) for n in sizes], threads=2, piece=PAGE, held=16,
                 unlock_later=handed.append)
    assert handed == [] and driver.locked == {} and driver.contexts == 0 and not _mapped(path)


def test_a_piece_the_driver_will_not_unlock_keeps_the_file_mapped_and_is_an_error(
        monkeypatch: pytest.MonkeyPatch, weights: tuple[Path, list[int], bytes]) -> None:
    path, sizes, _ = weights
    driver = FakeDriver()
    _install(monkeypatch, driver)
    handed: list[copiers.LockedPages] = []
    dma_into(path, _layout(sizes), [FakeTarget(n) for n in sizes], threads=1, piece=PAGE, held=16,
             unlock_later=handed.append)
    [pages] = handed
    stuck = sorted(driver.locked)[3]
    driver.refuse_unlock = {stuck}
    with pytest.warns(UserWarning, match="cuMemHostUnregister"), \
            pytest.raises(copiers.UnlockRefused, match="1 piece"):
        pages.release()
    # the others are unlocked; the refused one is kept, and the file stays mapped (unmapping a
    # locked range would leave it locked)
    assert list(driver.locked) == [stuck] and pages.pieces == 1 and _mapped(path) and driver.contexts == 0
    driver.refuse_unlock = set()
    assert pages.release()["unlocked_pieces"] == 1
    assert driver.locked == {} and not _mapped(path)


def test_without_unlock_later_a_refused_unlock_fails_the_load(monkeypatch: pytest.MonkeyPatch,
                                                              weights: tuple[Path, list[int], bytes]) -> None:
    path, sizes, _ = weights
    driver = FakeDriver()
    _install(monkeypatch, driver)
    original = driver.cuMemHostRegister

    def register_then_refuse_its_unlock(address: int, size: int, flags: int) -> tuple[int]:
        if not driver.refuse_unlock:
            driver.refuse_unlock = {address}
        return original(address, size, flags)

    driver.cuMemHostRegister = register_then_refuse_its_unlock  # type: ignore[method-assign]
    with pytest.warns(UserWarning), pytest.raises(copiers.UnlockRefused):
        dma_into(path, _layout(sizes), [FakeTarget(n) for n in sizes], threads=2, piece=PAGE, held=2)
    assert list(driver.locked) == list(driver.refuse_unlock) and _mapped(path)


class FakeLockedPages:
    """A LockedPages that counts its releases; ``refuse`` times it raises UnlockRefused first."""

    def __init__(self, pieces: int, refuse: int = 0) -> None:
        self._pieces, self.refuse, self.calls, self.pauses = pieces, refuse, 0, []
        self.released = threading.Event()

    @property
    def pieces(self) -> int:
        return self._pieces

    def release(self, pause_s: float = 0.0) -> dict[str, float]:
        self.calls += 1
        self.pauses.append(pause_s)
        if self.refuse:
            self.refuse -= 1
            raise copiers.UnlockRefused("CUDA would not unlock 1 piece(s)")
        done, self._pieces = self._pieces, 0
        self.released.set()
        return {"unlocked_pieces": float(done), "unlock_s": 0.001} if done else {}


def _worker() -> weights_extension.WeightsFileExtension:
    return weights_extension.WeightsFileExtension.__new__(weights_extension.WeightsFileExtension)


def test_the_worker_unlocks_in_the_background_and_a_sleep_waits_for_it(capsys: pytest.CaptureFixture[str]) -> None:
    worker = _worker()
    assert worker.vsnap_unlock_weights_file(True) == {}  # nothing was loaded
    pages = FakeLockedPages(5)
    worker._vsnap_locked = [pages]
    assert worker.vsnap_unlock_weights_file(True) == {"unlocking_pieces": 5.0}
    assert pages.released.wait(10) and pages.pauses == [copiers.UNLOCK_PAUSE_S]
    assert worker.vsnap_unlock_weights_file(False) == {}  # joined the thread; nothing left
    assert "weights file unlocked" in capsys.readouterr().out and worker._vsnap_locked == []


def test_pieces_a_background_unlock_could_not_unlock_fail_the_next_sleep(capsys: pytest.CaptureFixture[str]) -> None:
    worker = _worker()
    pages = FakeLockedPages(3, refuse=2)
    worker._vsnap_locked = [pages]
    worker.vsnap_unlock_weights_file(True)
    worker._vsnap_unlocking.join(10)
    assert "would not unlock" in capsys.readouterr().out and worker._vsnap_locked == [pages]  # kept, not lost
    with pytest.raises(copiers.UnlockRefused):  # the sleep before a checkpoint stops there
        worker.vsnap_unlock_weights_file(False)
    assert worker.vsnap_unlock_weights_file(False) == {"unlocked_pieces": 3.0, "unlock_s": 0.001}
    assert worker._vsnap_locked == [] and pages.calls == 3


def test_the_stack_limit_is_lowered_once_and_put_back_once(monkeypatch: pytest.MonkeyPatch) -> None:
    torch = types.ModuleType("torch")
    torch.cuda = types.SimpleNamespace(synchronize=lambda: None, empty_cache=lambda: None)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setattr(weights_extension, "release_heap", lambda: 0.0)
    monkeypatch.setattr(weights_extension, "freeze_heap", lambda: 0)  # never this test process's heap
    monkeypatch.setattr(weights_extension, "device_memory_report", lambda: {})
    monkeypatch.setattr(weights_extension, "_device_used", lambda: 0)
    limits = iter([(1024, 277 << 20), (0, 0)])
    lowered: list[int] = []
    monkeypatch.setattr(weights_extension, "lower_stack_limit", lambda: lowered.append(1) or next(limits))
    put_back: list[int] = []

    def set_limit(value: int) -> dict[str, float]:
        if value != 1024:
            raise AssertionError(f"the stack limit put back as {value}")
        put_back.append(value)
        return {"stack_restore_s": 0.0}

    monkeypatch.setattr(weights_extension, "set_stack_limit", set_limit)
    monkeypatch.delenv(weights_extension.STACK_ENV, raising=False)
    worker = _worker()
    assert worker.vsnap_release_memory()["stack_freed_bytes"] == 277 << 20
    worker.vsnap_release_memory()  # a second sleep without a wake: not lowered again (it would record 0)
    assert lowered == [1]
    assert worker.vsnap_restore_stack_limit() == {"stack_restore_s": 0.0} and put_back == [1024]
    assert worker.vsnap_restore_stack_limit() == {}  # once
    monkeypatch.setenv(weights_extension.STACK_ENV, "keep")
    assert "stack_freed_bytes" not in worker.vsnap_release_memory() and lowered == [1]


# --- weights by reference: dma_plan_into over the model's files and the rank file ---------------

from tests.unit.test_weights_reference import random_bytes, write_safetensors  # noqa: E402
from vsnap.engine.adapters.vllm.weights import reference_copiers  # noqa: E402
from vsnap.engine.adapters.vllm.weights.reference_copiers import dma_plan_into, plan_pieces  # noqa: E402
from vsnap.engine.adapters.vllm.weights.references import IMAGE, Plan, write_by_reference  # noqa: E402


@pytest.fixture
def referenced(tmp_path: Path) -> tuple[Plan, Path, list[int], bytes]:
    """A plan over one model file and a rank file: a fused tensor of two checkpoint tensors whose
    file offsets are not page-aligned, literal bytes, a third, and the first again (tied: the same
    file bytes read twice)."""
    model = tmp_path / "model"
    model.mkdir()
    a, b, c = random_bytes(20 * PAGE + 13, 1), random_bytes(17 * PAGE + 1, 2), random_bytes(16 * PAGE, 3)
    write_safetensors(model / "model.safetensors", {"a": a, "b": b, "c": c})
    pool = [np.concatenate([a, b]), random_bytes(3 * PAGE + 5, 4), c, a.copy(), random_bytes(777, 5)]
    rank_path = tmp_path / "rank0.bin"
    with open(rank_path, "wb") as f:
        plan = write_by_reference(f, pool, str(model))
    assert [e.source for e in plan.extents] == [0, 0, IMAGE, 0, 0, IMAGE]
    assert not _mapped(model / "model.safetensors")  # the matcher unmapped it
    return plan, rank_path, [p.size for p in pool], b"".join(p.tobytes() for p in pool)


def _mapped_any(plan: Plan, rank_path: Path) -> bool:
    return _mapped(rank_path) or _mapped(plan.model_path(0))


@pytest.mark.parametrize("piece_pages,threads,held", [(1, 3, 2), (3, 2, 2), (4, 4, 2), (64, 1, 2), (1, 1, 16)])
def test_a_plan_lands_every_byte_with_at_most_held_pieces_locked_per_thread(
        monkeypatch: pytest.MonkeyPatch, referenced: tuple[Plan, Path, list[int], bytes], piece_pages: int,
        threads: int, held: int) -> None:
    plan, rank_path, sizes, data = referenced
    driver = FakeDriver()  # refuses an overlapping registration and a copy from unlocked memory
    _install(monkeypatch, driver)
    targets = [FakeTarget(n) for n in sizes]
    result = dma_plan_into(plan, rank_path, _layout(sizes), targets, threads=threads, piece=piece_pages * PAGE,
                           held=held)
    pieces = len(plan_pieces(plan, _layout(sizes), piece_pages * PAGE, PAGE))
    assert result["weights_registered_pieces"] == pieces == driver.registrations
    assert result["weights_referenced_bytes"] == plan.referenced_bytes
    assert b"".join(t.bytes() for t in targets) == data
    assert driver.peak <= held * min(threads, pieces)
    assert driver.locked == {} and driver.contexts == 0 and not _mapped_any(plan, rank_path)


def test_the_pieces_of_a_plan_cover_each_page_once_and_only_what_is_read(
        referenced: tuple[Plan, Path, list[int], bytes]) -> None:
    plan, _, sizes, _ = referenced
    pieces = plan_pieces(plan, _layout(sizes), 2 * PAGE, PAGE)
    for source in (IMAGE, 0):
        ranges = sorted((p.lo, p.hi) for p in pieces if p.source == source)
        assert all(lo % PAGE == 0 for lo, _ in ranges) and all(a[1] <= b[0] for a, b in zip(ranges, ranges[1:]))
    model_bytes = sum(p.hi - p.lo for p in pieces if p.source == 0)
    header_pages = min(e.offset for e in plan.extents if e.source == 0) // PAGE * PAGE
    assert model_bytes == plan.files[0].size - header_pages  # the header's whole pages are not locked
    assert sum(n for p in pieces for *_, n in p.copies) == plan.total_bytes


def test_an_all_literal_plan_takes_the_pieces_dma_into_takes(tmp_path: Path) -> None:
    sizes = [1, 5 * PAGE + 13, PAGE, 0, 7 * PAGE - 1]
    with open(tmp_path / "rank0.bin", "wb") as f:
        plan = write_by_reference(f, [random_bytes(n, k) for k, n in enumerate(sizes)], str(tmp_path))
    pieces = plan_pieces(plan, _layout(sizes), 3 * PAGE, PAGE)
    assert [(p.lo, p.hi) for p in pieces] == [(lo, min(lo + 3 * PAGE, sum(sizes))) for lo in range(0, sum(sizes), 3 * PAGE)]


@pytest.mark.parametrize("refuse_at,held", [(1, 2), (3, 2), (6, 2), (3, 16)])
def test_a_refused_lock_of_a_plan_leaves_nothing_locked_or_mapped(
        monkeypatch: pytest.MonkeyPatch, referenced: tuple[Plan, Path, list[int], bytes], refuse_at: int,
        held: int) -> None:
    plan, rank_path, sizes, _ = referenced
    driver = FakeDriver(refuse_at=refuse_at)
    _install(monkeypatch, driver)
    with pytest.raises(RegistrationRefused, match="cuMemHostRegister"):
        dma_plan_into(plan, rank_path, _layout(sizes), [FakeTarget(n) for n in sizes], threads=2, piece=PAGE,
                      held=held)
    assert driver.locked == {} and driver.contexts == 0 and not _mapped_any(plan, rank_path)
    if (refuse_at, held) == (6, 2):
        assert (driver.unlocks_at_failure or 0) > 0


@pytest.mark.parametrize("fail_copy_at", [2, 12])
def test_a_failed_copy_of_a_plan_is_an_error_with_nothing_left_locked(
        monkeypatch: pytest.MonkeyPatch, referenced: tuple[Plan, Path, list[int], bytes], fail_copy_at: int) -> None:
    plan, rank_path, sizes, _ = referenced
    driver = FakeDriver(fail_copy_at=fail_copy_at)
    _install(monkeypatch, driver)
    handed: list[copiers.LockedPages] = []
    with pytest.raises(RuntimeError, match="to the GPU"):
        dma_plan_into(plan, rank_path, _layout(sizes), [FakeTarget(n) for n in sizes], threads=2, piece=PAGE,
                      held=2, unlock_later=handed.append)
    assert handed == [] and driver.locked == {} and driver.contexts == 0 and not _mapped_any(plan, rank_path)


@pytest.mark.parametrize("threads,held", [(2, 16), (3, 2)])
def test_unlock_later_gets_the_locked_pieces_of_each_file(
        monkeypatch: pytest.MonkeyPatch, referenced: tuple[Plan, Path, list[int], bytes], threads: int,
        held: int) -> None:
    plan, rank_path, sizes, data = referenced
    driver = FakeDriver()
    _install(monkeypatch, driver)
    targets = [FakeTarget(n) for n in sizes]
    handed: list[copiers.LockedPages] = []
    result = dma_plan_into(plan, rank_path, _layout(sizes), targets, threads=threads, piece=PAGE, held=held,
                           unlock_later=handed.append)
    assert b"".join(t.bytes() for t in targets) == data
    assert len(handed) == 2  # the rank file's and the model file's
    kept = sum(pages.pieces for pages in handed)
    assert kept == len(driver.locked) == result["weights_unlocked_later_pieces"] > 0
    assert _mapped(rank_path) and _mapped(plan.model_path(0))
    assert copiers.release_all(handed, 0.0)["unlocked_pieces"] == kept
    assert driver.locked == {} and driver.contexts == 0 and not _mapped_any(plan, rank_path)


def test_a_model_file_that_changed_or_cannot_be_mapped_is_refused_before_anything_is_locked(
        monkeypatch: pytest.MonkeyPatch, referenced: tuple[Plan, Path, list[int], bytes]) -> None:
    plan, rank_path, sizes, _ = referenced
    driver = FakeDriver()
    _install(monkeypatch, driver)
    real_mmap, calls = reference_copiers.mmap.mmap, []

    def second_fails(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 2:
            raise OSError(12, "Cannot allocate memory")
        return real_mmap(*args, **kwargs)

    monkeypatch.setattr(reference_copiers.mmap, "mmap", second_fails)
    with pytest.raises(RegistrationRefused, match="cannot be mapped"):
        dma_plan_into(plan, rank_path, _layout(sizes), [FakeTarget(n) for n in sizes], piece=PAGE)
    assert driver.registrations == 0 and not _mapped_any(plan, rank_path)
    monkeypatch.setattr(reference_copiers.mmap, "mmap", real_mmap)
    with open(plan.model_path(0), "ab") as f:
        f.write(b"\0")
    with pytest.raises(ValueError, match="changed since the capture"):
        dma_plan_into(plan, rank_path, _layout(sizes), [FakeTarget(n) for n in sizes], piece=PAGE)
    assert driver.registrations == 0 and not _mapped_any(plan, rank_path)


def test_a_refused_unlock_of_a_plan_fails_the_load_and_keeps_only_that_file_mapped(
        monkeypatch: pytest.MonkeyPatch, referenced: tuple[Plan, Path, list[int], bytes]) -> None:
    plan, rank_path, sizes, _ = referenced
    driver = FakeDriver()
    _install(monkeypatch, driver)
    original = driver.cuMemHostRegister

    def register_then_refuse_its_unlock(address: int, size: int, flags: int) -> tuple[int]:
        if not driver.refuse_unlock:
            driver.refuse_unlock = {address}
        return original(address, size, flags)

    driver.cuMemHostRegister = register_then_refuse_its_unlock  # type: ignore[method-assign]
    with pytest.warns(UserWarning), pytest.raises(copiers.UnlockRefused):
        dma_plan_into(plan, rank_path, _layout(sizes), [FakeTarget(n) for n in sizes], threads=2, piece=PAGE, held=2)
    # the first piece is the rank file's (pieces go file by file, the rank file first): it stays locked and
    # mapped; the model file's pieces were all unlocked and it is unmapped
    assert list(driver.locked) == list(driver.refuse_unlock) and _mapped(rank_path)
    assert not _mapped(plan.model_path(0))


def test_what_survives_the_release_is_frozen_after_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Session 16: vLLM 0.32+ begins every wake_up with a full gc.collect() in the worker; the heap
    the image holds is frozen right after the release collected its garbage, so a restore's wakes
    scan only what the restored process made. The collection's seconds are reported."""
    torch = types.ModuleType("torch")
    torch.cuda = types.SimpleNamespace(synchronize=lambda: None, empty_cache=lambda: calls.append("empty_cache"))  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch", torch)
    calls: list[str] = []
    monkeypatch.setattr(weights_extension, "release_heap", lambda: calls.append("collect") or 0.25)
    monkeypatch.setattr(weights_extension, "freeze_heap", lambda: calls.append("freeze") or 123)
    monkeypatch.setattr(weights_extension, "device_memory_report", lambda: {})
    monkeypatch.setattr(weights_extension, "_device_used", lambda: 0)
    monkeypatch.setenv(weights_extension.STACK_ENV, "keep")
    report = _worker().vsnap_release_memory()
    assert calls == ["collect", "empty_cache", "freeze"]
    assert report["gc_frozen_objects"] == 123.0 and report["gc_collect_s"] == 0.25


def test_freeze_heap_leaves_a_full_collection_nothing_to_scan() -> None:
    """The real gc, in a process of its own (freezing this one's heap would outlive the test)."""
    import subprocess

    code = ("import gc; from vsnap.engine.heap import freeze_heap, release_heap; "
            "junk = [[i] for i in range(100000)]; release_heap(); n = freeze_heap(); "
            "print(n >= 100000, gc.get_freeze_count() == n, len(gc.get_objects()) < 1000)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert result.stdout.split() == ["True", "True", "True"], result.stdout + result.stderr


def _meminfo(tmp_path: Path, available_gib: int, swap_kib: int = 0) -> Path:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal:       {128 << 20} kB\nMemAvailable:   {available_gib << 20} kB\n"
                       f"SwapTotal:      {swap_kib} kB\n")
    return meminfo


def test_pieces_held_keeps_every_piece_locked_when_the_reclaimable_ones_fit(tmp_path: Path) -> None:
    """Like session 18's 70B: ~146 pieces of 512 MiB over 4 threads, 56 GiB available. From a tmpfs
    (2 reclaimable pieces: the image's rank file) every piece stays locked while the copies run;
    from a disk's page cache (all reclaimable: 73 GiB > 28) DMA_HELD lowered to what memory allows,
    as before, and never more than DMA_HELD per thread; a caller's own cap is kept (lowered by
    memory)."""
    meminfo, piece = _meminfo(tmp_path, 56), 512 << 20
    assert copiers.pieces_held(None, 4, piece, pieces=146, reclaimable=2, meminfo=meminfo) == 146
    assert copiers.pieces_held(None, 4, piece, pieces=146, reclaimable=146, meminfo=meminfo) == 14
    # a disk's 40 GiB within a big host's memory: still no more than DMA_HELD per thread, as before
    big = _meminfo(tmp_path, 512)
    assert copiers.pieces_held(None, 4, piece, pieces=80, reclaimable=80, meminfo=big) == copiers.DMA_HELD
    assert copiers.pieces_held(None, 4, piece, pieces=32, reclaimable=32, meminfo=meminfo) == 32  # an 8B: none unlocked, as before
    assert copiers.pieces_held(None, 4, piece, pieces=1, reclaimable=1, meminfo=meminfo) == 2  # never fewer than 2
    assert copiers.pieces_held(4, 4, piece, pieces=146, reclaimable=0, meminfo=meminfo) == 4
    assert copiers.pieces_held(None, 4, piece, pieces=146, reclaimable=2, meminfo=tmp_path / "absent") == 2


def test_a_tmpfs_file_is_in_memory_only_without_swap(tmp_path: Path) -> None:
    def magic(path: Path) -> int | None:
        fd = os.open(path, os.O_RDONLY)
        try:
            return copiers._filesystem_magic(fd)
        finally:
            os.close(fd)

    shm = Path("/dev/shm")
    if magic(shm) != 0x01021994:
        pytest.skip("/dev/shm is not a tmpfs here")
    on_disk = tmp_path / "f"
    on_disk.write_bytes(b"x")
    for path, in_memory in ((shm, True), (on_disk, magic(on_disk) in copiers.IN_MEMORY_FILESYSTEMS)):
        fd = os.open(path, os.O_RDONLY)
        try:
            assert copiers.in_memory_file(fd, _meminfo(tmp_path, 56)) is in_memory
            assert copiers.in_memory_file(fd, _meminfo(tmp_path, 56, swap_kib=8 << 20)) is False  # swap: reclaimable
            assert copiers.in_memory_file(fd, tmp_path / "absent") is False
        finally:
            os.close(fd)


def test_a_file_in_memory_is_copied_with_no_piece_unlocked_before_the_end(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The unlocking that took the driver's lock from the copies: none while they run when the
    host's memory takes every piece (here in_memory_file). One thread, more pieces than DMA_HELD:
    before session 18 it unlocked its oldest from the 17th on."""
    pieces = 2 * copiers.DMA_HELD + 3
    data = os.urandom(pieces * PAGE - 5)
    path = tmp_path / "rank0.bin"
    path.write_bytes(data)
    driver = FakeDriver()
    _install(monkeypatch, driver)
    monkeypatch.setattr(copiers, "in_memory_file", lambda fd, meminfo=None: True)
    target = FakeTarget(len(data))
    result = dma_into(path, _layout([len(data)]), [target], threads=1, piece=PAGE)
    assert result["weights_registered_pieces"] == pieces and target.bytes() == data
    assert driver.peak == pieces and driver.locked == {}  # every piece locked at once, all unlocked at the end
    capped = FakeDriver()
    _install(monkeypatch, capped)
    dma_into(path, _layout([len(data)]), [FakeTarget(len(data))], threads=1, piece=PAGE, held=16)
    assert capped.peak == 16 and capped.locked == {}  # a caller's own cap still holds
