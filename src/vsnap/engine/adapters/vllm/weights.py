"""The model's weights as one flat file per rank, written at capture, streamed back at restore.

vLLM's own reload after sleep level 2 runs its model loader again: safetensors through pageable
copies and the model's weight-loading code, about 6 GB/s on an H200 (and in vLLM 0.26 it cannot
reload a LoRA-wrapped model at all). This file holds every tensor of the
sleep allocator's weights pool exactly as it sits on the GPU once loaded and processed (each
storage whole, in address order: parameters, quantization scales, LoRA slots; see pool_tensors),
so a restore only has to move bytes: by default the GPU copies them straight from the page cache,
page-locked piece by piece in place (dma_into); where CUDA refuses that, several threads read
pieces of the file into pinned host buffers and copy each to its tensor with an asynchronous
host-to-device copy while the next piece is read (buffered_into).

``WeightsFileExtension`` is mixed into vLLM's GPU worker (vLLM's ``worker_extension_cls``); the
engine calls its methods through ``collective_rpc``. The layout (names, sizes) and views of the
tensors are kept in the worker's memory, which the CRIU image carries: a restore checks every
parameter still lives in a storage the file covers before it copies a byte.
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import mmap
import os
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from vsnap.engine.heap import release_heap

from .tp import TensorParallelExtension

CHUNK = 32 << 20  # bytes read and copied at a time by one thread
THREADS = 8  # readers (H200 host, 8B: 8 read 17.6 GB/s from the page cache, 12 read 15.6 GB/s); each owns two pinned buffers (one read into while the other is copied)
DMA_THREADS = 4  # dma_into's threads (H200 host, 17.2 GB: 4 and 8 both ~26 GB/s, bound by page-locking)
DMA_PIECE = 512 << 20  # bytes page-locked and copied at a time by one of them
DMA_HELD = 16  # pieces each thread keeps locked before it unlocks its oldest (4 x 16 x 512 MiB: 32 GiB at most)
UNLOCK_PAUSE_S = 0.02  # between two pieces unlocked once the server serves: its launches take the driver's lock between them
DMA_ENV = "VSNAP_WEIGHTS_DMA"  # "0" in the capture's environment: the buffered path only (default: dma_into first)
EXTENSION = f"{__name__}.WeightsFileExtension"
# The CUDA graph pool's allocations in vLLM's sleep-mode allocator carry the KV cache's tag: vLLM
# discards that memory at sleep and maps fresh memory at the same addresses at wake, which is what
# scratch memory needs (see route_graph_pool_to_sleep_allocator).
GRAPH_POOL_TAG = "kv_cache"
STACK_ENV = "VSNAP_CUDA_STACK"  # "keep" in the capture's environment: the stack reservation stays in the checkpoint (default: lower_stack_limit)
GRAPH_POOL_ENV = "VSNAP_GRAPH_POOL"  # "sleep": the worker routes the pool when it imports this module


@dataclass(frozen=True)
class Segment:
    name: str
    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]


def file_name(rank: int) -> str:
    return f"rank{rank}.bin"


def layout(named: list[tuple[str, Any]]) -> list[Segment]:
    """Where each parameter lives in the file (byte offsets; parameters back to back)."""
    segments, offset = [], 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        segments.append(Segment(name, offset, nbytes, str(tensor.dtype), tuple(tensor.shape)))
        offset += nbytes
    return segments


def flat_bytes(tensor: Any) -> Any:
    """The tensor's storage as a 1-D uint8 tensor (the same memory)."""
    import torch

    if not tensor.is_contiguous():
        raise ValueError("parameter is not contiguous")
    return tensor.detach().reshape(-1).view(torch.uint8)


class HostBuffer:
    """A host buffer for one chunk. For CUDA targets it is registered with CUDA (page-locked)
    without torch's caching host allocator, so nothing of it stays in the process (and in a later
    image) once closed."""

    def __init__(self, size: int, pinned: bool) -> None:
        import torch

        self.map = mmap.mmap(-1, size)
        self.tensor = torch.frombuffer(self.map, dtype=torch.uint8)
        self.view = memoryview(self.map)
        self.registered = pinned and torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), size, 0) == 0

    def close(self) -> None:
        import torch

        if self.registered:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
        self.view.release()
        del self.tensor
        try:
            self.map.close()
        except BufferError:  # a view is still alive somewhere: the mapping goes with it
            pass


def _read_into(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise OSError(f"weights file ended at byte {offset + done}")
        done += n


def held_within_memory(held: int, threads: int, piece: int, meminfo: Path = Path("/proc/meminfo")) -> int:
    """``held``, lowered (to 2 at least) so that every thread's locked pieces together stay within
    half of the host's MemAvailable: locked page-cache pages cannot be reclaimed until unlocked."""
    try:
        fields = dict(line.split(":", 1) for line in meminfo.read_text().splitlines() if ":" in line)
        available = int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return 2  # unknown: the least
    return max(2, min(held, available // 2 // max(threads * piece, 1)))


class RegistrationRefused(Exception):
    """CUDA would not page-lock the mapped file (dma_into); the buffered path copies instead."""


def _overlaps(starts: list[int], segments: list[Segment], lo: int, hi: int) -> list[tuple[int, int, int]]:
    """(segment index, first byte, end byte) of each segment's part within the file's [lo, hi)."""
    parts = []
    for k in range(max(bisect.bisect_right(starts, lo) - 1, 0), len(segments)):
        seg = segments[k]
        a, b = max(lo, seg.offset), min(hi, seg.offset + seg.nbytes)
        if a >= hi:
            break
        if a < b:
            parts.append((k, a, b))
    return parts


def dma_into(path: Path, segments: list[Segment], targets: list[Any], *, threads: int = DMA_THREADS,
             piece: int = DMA_PIECE, held: int = DMA_HELD,
             unlock_later: Callable[[LockedPages], None] | None = None) -> dict[str, float]:
    """Copy the file's bytes into CUDA ``targets`` straight from the page cache: the file mapped
    read-only, each piece page-locked in place (cuMemHostRegister) and copied by the GPU's copy
    engine, no host-side copy at all. Threads lock pieces while others' copies run. Each thread
    holds at most ``held`` pieces locked (it waits for its oldest piece's copies and unlocks it
    before it locks another; fewer where the host's memory is short: held_within_memory), so at
    most held x threads x piece bytes of the page cache are locked at once; the rest are
    unlocked once every copy is done. The driver's locking and unlocking appear to share one
    lock (threads that only copied beside the lockings slowed them too), so unlocking between
    lockings slows them down. On the H200 host (scripts/weights-dma-bench.py, 17.2 GB from the
    page cache): 4 threads holding 2 pieces each 0.69 to 0.75 s, holding 16 each 0.58 s, the
    buffered path 0.83 to 0.85 s; inside an 8B restore 0.72 s (0.60 s with unlock_later, session 10).

    With ``unlock_later``, the pieces still locked once every copy is done are not unlocked here:
    they are handed, with the file's mapping, to ``unlock_later`` as one LockedPages, whose
    release() the caller runs when the driver's lock is not on its critical path (a restore: once
    the server serves). On any failure everything is unlocked here, as without it.

    Raises RegistrationRefused when this path cannot run here (no cuda-bindings, the
    file cannot be mapped, no stream, CUDA will not lock the mapping), before or after some pieces
    were copied: every copy issued has finished by then, and the caller copies everything again
    its own way. A copy the GPU fails raises RuntimeError."""
    if piece <= 0 or piece % mmap.PAGESIZE:
        raise ValueError(f"piece must be a positive multiple of the page size ({mmap.PAGESIZE}), not {piece}")
    if held < 2:
        raise ValueError(f"held must be at least 2 (one piece copied while the next is locked), not {held}")
    total = segments[-1].offset + segments[-1].nbytes if segments else 0
    if not total:
        return {"weights_bytes": 0.0, "weights_load_s": 0.0, "weights_gb_per_s": 0.0, "weights_registered_pieces": 0.0}
    try:
        import numpy as np
        from cuda.bindings import driver as cu
    except ImportError as exc:
        raise RegistrationRefused(f"no cuda-bindings ({exc})") from None
    ok = cu.CUresult.CUDA_SUCCESS
    starts = [s.offset for s in segments]
    addresses = [t.data_ptr() for t in targets]
    ordinal = targets[0].device.index or 0
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        if os.fstat(fd).st_size != total:
            raise ValueError(f"{path} has {os.fstat(fd).st_size} bytes; the parameters need {total}")
        try:
            mapping = mmap.mmap(fd, total, prot=mmap.PROT_READ, flags=mmap.MAP_SHARED)
        except OSError as exc:
            raise RegistrationRefused(f"{path} cannot be mapped: {exc.strerror}") from None
    finally:
        os.close(fd)
    view = np.frombuffer(mapping, dtype=np.uint8)
    base = int(view.ctypes.data)
    pieces = (total + piece - 1) // piece
    workers = min(threads, pieces)
    held = held_within_memory(held, workers, piece)
    counter = itertools.count()
    stop = threading.Event()  # one thread's failure ends the others' work at their next piece
    kept: list[tuple[int, Any]] = []  # pieces left locked for unlock_later, their copies done
    kept_lock = threading.Lock()
    start = time.monotonic()

    def worker() -> int:
        err, device = cu.cuDeviceGet(ordinal)
        err2, context = cu.cuDevicePrimaryCtxRetain(device) if err == ok else (err, None)
        if err2 != ok:
            raise RegistrationRefused(f"no CUDA context for device {ordinal}: {err2}")
        locked: list[tuple[int, Any]] = []  # (address, event after its copies), oldest first
        stream = None
        try:
            (err,) = cu.cuCtxSetCurrent(context)  # the primary context torch uses, on this thread
            err2, stream = cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING) if err == ok else (err, None)
            if err2 != ok:
                raise RegistrationRefused(f"no CUDA stream: {err2}")
            done = 0
            while not stop.is_set() and (index := next(counter)) < pieces:
                if len(locked) == held:  # the oldest piece's copies must be done before it is unlocked
                    address, event = locked.pop(0)
                    (err,) = cu.cuEventSynchronize(event)
                    if not _unlock(cu, address, event):
                        with kept_lock:
                            kept.append((address, None))  # still locked: release() tries again, and says so
                    if err != ok:
                        raise RuntimeError(f"copying the weights to the GPU: {err}")
                lo = index * piece
                hi = min(lo + piece, total)
                (err,) = cu.cuMemHostRegister(base + lo, hi - lo, cu.CU_MEMHOSTREGISTER_READ_ONLY)
                if err != ok:
                    raise RegistrationRefused(f"cuMemHostRegister of {path} at byte {lo}: {err}")
                err, event = cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING)
                locked.append((base + lo, event if err == ok else None))
                if err != ok:
                    raise RegistrationRefused(f"no CUDA event: {err}")
                for k, a, b in _overlaps(starts, segments, lo, hi):
                    (err,) = cu.cuMemcpyHtoDAsync(addresses[k] + a - segments[k].offset, base + a, b - a, stream)
                    if err != ok:
                        raise RuntimeError(f"copying {segments[k].name} to the GPU: {err}")
                (err,) = cu.cuEventRecord(event, stream)
                if err != ok:
                    raise RuntimeError(f"copying the weights to the GPU: {err}")
                done += 1
            (err,) = cu.cuStreamSynchronize(stream)
            if err != ok:
                raise RuntimeError(f"copying the weights to the GPU: {err}")
            return done
        except BaseException:
            stop.set()
            raise
        finally:
            if stream is not None:
                cu.cuStreamSynchronize(stream)  # no copy may still read a piece once it is unlocked
            still = locked if unlock_later is not None and not stop.is_set() else [
                (address, None) for address, event in locked if not _unlock(cu, address, event)]
            with kept_lock:
                kept.extend(still)
            if stream is not None:
                cu.cuStreamDestroy(stream)
            cu.cuDevicePrimaryCtxRelease(device)

    locked_pages = LockedPages(ordinal, mapping, view, kept)
    del view
    try:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            futures = [pool.submit(worker) for _ in range(workers)]
        errors = [f.exception() for f in futures if f.exception() is not None]
        if errors:  # a failed copy before a refusal: it is the one to report
            raise next((e for e in errors if not isinstance(e, RegistrationRefused)), errors[0])
        done = sum(f.result() for f in futures)
    except BaseException:
        locked_pages.release()  # what finished threads kept; the mapping goes with it
        raise
    seconds = time.monotonic() - start
    if unlock_later is None:
        locked_pages.release()
    else:
        try:
            unlock_later(locked_pages)
        except BaseException:
            locked_pages.release()
            raise
    return {"weights_bytes": float(total), "weights_load_s": seconds, "weights_gb_per_s": total / max(seconds, 1e-9) / 1e9,
            "weights_registered_pieces": float(done), "weights_unlocked_later_pieces": float(len(kept))}


class LockedPages:
    """Pieces of a mapped weights file that dma_into left page-locked after their copies were done,
    and the mapping itself. release() unlocks them (one at a time, ``pause_s`` apart: each unlock
    waits for the GPU's work in flight and holds the driver's lock, so launches wait behind it) and
    unmaps the file. A piece the driver will not unlock stays in the object, with the mapping
    (unmapping a locked range leaves it locked), and release() raises UnlockRefused; a later call
    tries again. Once all are unlocked, a call does nothing."""

    def __init__(self, ordinal: int, mapping: mmap.mmap, view: Any, pieces: list[tuple[int, Any]]) -> None:
        self._ordinal, self._mapping, self._view, self._pieces = ordinal, mapping, view, pieces
        self._lock = threading.Lock()

    @property
    def pieces(self) -> int:
        return len(self._pieces)

    def release(self, pause_s: float = 0.0) -> dict[str, float]:
        with self._lock:
            if self._mapping is None:
                return {}
            start = time.monotonic()
            unlocked = self._unlock_all(pause_s) if self._pieces else 0
            self._view = None
            self._mapping.close()
            self._mapping = None
            if self in _STILL_LOCKED:
                _STILL_LOCKED.remove(self)
            return {"unlocked_pieces": float(unlocked), "unlock_s": time.monotonic() - start}

    def _unlock_all(self, pause_s: float) -> int:
        from cuda.bindings import driver as cu

        ok = cu.CUresult.CUDA_SUCCESS
        err, device = cu.cuDeviceGet(self._ordinal)
        err2, context = cu.cuDevicePrimaryCtxRetain(device) if err == ok else (err, None)
        if err2 != ok:  # should not happen (torch holds the context)
            raise UnlockRefused(f"no CUDA context to unlock {len(self._pieces)} piece(s) of the weights file with: "
                                f"{err2}")
        unlocked, refused = 0, []
        try:
            (err,) = cu.cuCtxSetCurrent(context)
            if err != ok:
                raise UnlockRefused(f"cuCtxSetCurrent before unlocking the weights file: {err}")
            while self._pieces:
                address, event = self._pieces.pop(0)
                if _unlock(cu, address, event):
                    unlocked += 1
                else:
                    refused.append((address, None))
                if pause_s and self._pieces:
                    time.sleep(pause_s)
        finally:
            self._pieces[:0] = refused
            cu.cuDevicePrimaryCtxRelease(device)
        if refused:
            if self not in _STILL_LOCKED:  # its mapping must outlive every owner: an mmap unmaps when collected
                _STILL_LOCKED.append(self)
            raise UnlockRefused(f"CUDA would not unlock {len(refused)} piece(s) of the weights file (the engine log "
                                "has each); they stay locked until the engine exits")
        return unlocked


_STILL_LOCKED: list[LockedPages] = []  # pieces the driver would not unlock, kept mapped for the process's life


class UnlockRefused(RuntimeError):
    """The driver would not unlock pieces of the weights file: nothing may be checkpointed now."""


def _release_all(locked: list[LockedPages], pause_s: float) -> dict[str, float]:
    """Release each of ``locked`` (each at most once: a released one does nothing), then empty
    the list; on UnlockRefused the list keeps them all for the next try."""
    totals = {"unlocked_pieces": 0.0, "unlock_s": 0.0}
    for pages in locked:
        for key, value in pages.release(pause_s).items():
            totals[key] = totals.get(key, 0.0) + value
    locked.clear()
    return totals


def _unlock(cu: Any, address: int, event: Any) -> bool:
    """Unregister a piece dma_into locked (its copies are done) and free its event; False (and a
    warning) if the driver refused: the pages are still locked."""
    if event is not None:
        cu.cuEventDestroy(event)
    (err,) = cu.cuMemHostUnregister(address)
    if err != cu.CUresult.CUDA_SUCCESS:
        warnings.warn(f"vsnap: cuMemHostUnregister at {address:#x}: {err}", stacklevel=1)
        return False
    return True


def stream_into(path: Path, segments: list[Segment], targets: list[Any], *, threads: int = THREADS,
                chunk: int = CHUNK, unlock_later: Callable[[LockedPages], None] | None = None) -> dict[str, float]:
    """Copy the file's bytes into ``targets`` (flat uint8 tensors, one per segment): CUDA tensors
    from the page-locked page cache (dma_into, which hands its locked pages to ``unlock_later``
    if given; where CUDA refuses that, or with DMA_ENV=0 in the engine's environment, through
    pinned buffers and asynchronous copies); CPU tensors by plain copies. 8B on the H200, inside
    a restore: 0.60 s by dma_into (its pages unlocked later), 0.90 s buffered (NOTES.md)."""
    if targets and targets[0].device.type == "cuda" and os.environ.get(DMA_ENV) != "0":
        try:
            return dma_into(path, segments, targets, unlock_later=unlock_later)
        except RegistrationRefused as refused:
            warnings.warn(f"vsnap: {refused}; copying through pinned buffers", stacklevel=1)
            return {**buffered_into(path, segments, targets, threads=threads, chunk=chunk), "weights_dma_refused": 1.0}
    return buffered_into(path, segments, targets, threads=threads, chunk=chunk)


def buffered_into(path: Path, segments: list[Segment], targets: list[Any], *, threads: int = THREADS,
                  chunk: int = CHUNK) -> dict[str, float]:
    """Copy the file's bytes into ``targets`` through host buffers: several threads read pieces of
    the file into pinned buffers (CUDA targets, asynchronous copies) or copy them (CPU targets)."""
    import torch

    total = segments[-1].offset + segments[-1].nbytes if segments else 0
    starts = [s.offset for s in segments]
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        if size != total:
            raise ValueError(f"{path} has {size} bytes; the parameters need {total}")
        chunks = (total + chunk - 1) // chunk
        counter = itertools.count()  # next() is atomic under the GIL: chunks handed out in order
        device = targets[0].device if targets else None
        cuda = device is not None and device.type == "cuda"
        start = time.monotonic()

        def reader() -> None:
            if cuda:
                torch.cuda.set_device(device)
            stream = torch.cuda.Stream() if cuda else None
            buffers = [HostBuffer(chunk, cuda), HostBuffer(chunk, cuda)]
            pending: list[Any] = [None, None]
            try:
                for turn in itertools.count():
                    index = next(counter)
                    if index >= chunks:
                        break
                    slot = turn % 2
                    if pending[slot] is not None:
                        pending[slot].synchronize()  # that buffer's last copy is done
                    lo = index * chunk
                    n = min(chunk, total - lo)
                    buffer = buffers[slot]
                    _read_into(fd, buffer.view[:n], lo)
                    with torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
                        for k, a, b in _overlaps(starts, segments, lo, lo + n):
                            offset = segments[k].offset
                            targets[k][a - offset:b - offset].copy_(buffer.tensor[a - lo:b - lo], non_blocking=cuda)
                        if cuda:
                            pending[slot] = torch.cuda.Event()
                            pending[slot].record(stream)
                if stream is not None:
                    stream.synchronize()
            finally:
                for buffer in buffers:
                    buffer.close()

        with ThreadPoolExecutor(max_workers=threads) as pool:
            for future in [pool.submit(reader) for _ in range(min(threads, max(chunks, 1)))]:
                future.result()
        seconds = time.monotonic() - start
    finally:
        os.close(fd)
    return {"weights_bytes": float(total), "weights_load_s": seconds, "weights_gb_per_s": total / max(seconds, 1e-9) / 1e9}


def route_graph_pool_to_sleep_allocator() -> bool:
    """Let vLLM's CUDA graphs capture into a memory pool of its sleep-mode allocator (this process).

    Why: at sleep level 2 vLLM unmaps the weights and the KV cache, but the memory its CUDA graphs
    were captured into (activations between layers, the graphs' outputs) stays, so the CUDA
    checkpoint copies it to the host, CRIU writes it into the image and reads it back, and the CUDA
    restore copies it to the GPU again, at every restore. It is scratch: each replay writes it
    before it reads it. In a pool of vLLM's CuMemAllocator (tagged like the KV cache by
    tag_graph_pool) sleep unmaps it and wake maps fresh memory at the same addresses, so the graphs
    stay valid. The capture's rehearsal (sleep, wake, oracle) runs this path before any image is
    written.

    Replaces vLLM 0.26's ``Platform.get_global_graph_pool`` (the pool every CUDAGraphWrapper
    captures into) with one that, once the sleep allocator holds the weights, makes the pool
    there; otherwise vLLM's own pool. Returns False when this vLLM lacks what it patches.
    """
    try:
        import torch
        from vllm.device_allocator import cumem
        from vllm.platforms import current_platform
    except ImportError:
        return False
    platform = type(current_platform)
    if getattr(platform, "_vsnap_graph_pool_routed", False):
        return True
    if not hasattr(platform, "get_global_graph_pool") or not hasattr(platform, "_global_graph_pool") \
            or not getattr(cumem, "cumem_available", False):
        return False

    def get_global_graph_pool(self: Any) -> Any:
        cls = type(self)
        if cls._global_graph_pool is None:
            allocator = cumem.CuMemAllocator.instance
            if allocator is not None and "weights" in allocator.allocator_and_pools:
                plug = cumem.get_pluggable_allocator(allocator.python_malloc_callback,
                                                     allocator.python_free_callback)
                pool = torch.cuda.memory.MemPool(plug._allocator)
                allocator.allocator_and_pools["vsnap_cudagraph_pool"] = (pool, plug)  # kept alive with the others
                cls._global_graph_pool = pool.id
            else:
                cls._global_graph_pool = self.graph_pool_handle()
        return cls._global_graph_pool

    platform.get_global_graph_pool = get_global_graph_pool
    platform._vsnap_graph_pool_routed = True
    return True


def tag_graph_pool() -> int:
    """Give the CUDA graph pool's allocations the KV cache's tag; returns their bytes.

    The sleep allocator tags an allocation with the tag of the ``use_memory_pool`` block it is
    made in; the graph pool is allocated outside any (during capture), so its allocations carry the
    allocator's default tag, which vLLM discards at sleep but never maps again at wake. Every
    allocation of that tag is the graph pool's: vLLM makes all its own inside tagged blocks.
    """
    try:
        from vllm.device_allocator import cumem
    except ImportError:
        return 0
    allocator = cumem.CuMemAllocator.instance
    if allocator is None:
        return 0
    for ptr, data in allocator.pointer_to_data.items():
        if data.tag == cumem.CuMemAllocator.default_tag:
            data.tag = GRAPH_POOL_TAG
            _graph_pool_pointers.add(ptr)
    return sum(int(data.handle[1]) for ptr, data in allocator.pointer_to_data.items() if ptr in _graph_pool_pointers)


_graph_pool_pointers: set[int] = set()  # the sleep allocator's allocations that tag_graph_pool retagged


def device_memory_report() -> dict[str, float]:
    """What holds this process's GPU memory: the device's used bytes and torch's segments by pool.

    Pools: the sleep allocator's (weights and KV cache: unmapped while asleep, so not counted as
    held), torch's default pool, and the rest (CUDA graph pools); what no pool explains is the
    CUDA context (a bare one is 0.65 GB on an H200, 0.28 GB of it the per-thread stack reserved for
    every resident thread), loaded kernels, cuBLAS handles and the graphs' own executable state.
    """
    import torch

    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    cumem_tags: dict[int, str] = {}  # the sleep allocator's allocations: tag, or "asleep" while unmapped
    try:
        from vllm.device_allocator import cumem

        allocator = cumem.CuMemAllocator.instance
        if allocator is not None:
            cumem_tags = {ptr: "asleep" if data.is_asleep else data.tag
                          for ptr, data in allocator.pointer_to_data.items()}
    except ImportError:
        pass
    pools: dict[str, float] = {"default_pool_bytes": 0.0, "default_pool_active_bytes": 0.0,
                               "graph_pool_bytes": 0.0, "sleeping_bytes": 0.0}
    for segment in torch.cuda.memory_snapshot():
        size = float(segment["total_size"])
        tag = cumem_tags.get(segment["address"])
        if tag == "asleep":
            pools["sleeping_bytes"] += size
        elif tag is not None:
            pools[f"awake_{tag}_bytes"] = pools.get(f"awake_{tag}_bytes", 0.0) + size
        elif tuple(segment.get("segment_pool_id", (0, 0))) == (0, 0):
            pools["default_pool_bytes"] += size
            pools["default_pool_active_bytes"] += float(segment.get("active_size", 0))
        else:
            pools["graph_pool_bytes"] += size
    held = sum(v for k, v in pools.items() if k.endswith("_bytes") and k not in ("sleeping_bytes", "default_pool_active_bytes"))
    return {"gpu_used_bytes": float(total - free), **pools, "unpooled_bytes": float(total - free) - held}


def weights_pool_ranges() -> list[tuple[int, int]]:
    """The address ranges of vLLM's sleep allocator tagged "weights": what sleep level 2 discards
    and wake maps again, empty, at the same addresses."""
    try:
        from vllm.device_allocator import cumem
    except ImportError:
        return []
    allocator = cumem.CuMemAllocator.instance
    if allocator is None:
        return []
    return sorted((int(ptr), int(ptr) + int(data.handle[1])) for ptr, data in allocator.pointer_to_data.items()
                  if data.tag == "weights")


def pool_membership(ranges: list[tuple[int, int]]) -> Callable[[int], bool]:
    """A test of whether an address lies in one of ``ranges`` (sorted, disjoint)."""
    starts = [lo for lo, _ in ranges]

    def inside(ptr: int) -> bool:
        k = bisect.bisect_right(starts, ptr) - 1
        return k >= 0 and ptr < ranges[k][1]

    return inside


def storage_view(tensor: Any) -> Any:
    """A flat uint8 tensor over the whole storage behind ``tensor`` (the same memory, kept alive)."""
    import torch

    storage = tensor.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage, 0, (storage.nbytes(),), (1,))


def pool_tensors(model: Any, ranges: list[tuple[int, int]] | None = None, device: str = "cuda") -> list[tuple[str, Any]]:
    """Every storage in the weights pool that a Python object holds, except the model's buffers
    (vLLM saves those at sleep and puts them back at wake), as (name, flat uint8 view) in address
    order.

    Parameters are not all of a model's loaded state: quantization scales kept as plain
    attributes, LoRA slots, MoE routing tables are tensors too, made while the model loaded, so in
    the weights pool, and lost at sleep like the parameters. A tensor is named after the parameter
    whose storage it is, else ``tensor@<offset in the pool> <dtype>[<shape>]``. Two storages that overlap raise
    ValueError (then the capture reloads through vLLM). ``ranges`` and ``device``: the pool's
    address ranges (default: vLLM's sleep allocator's) and the tensors' device type."""
    import torch

    ranges = weights_pool_ranges() if ranges is None else sorted(ranges)
    if not ranges:
        return []
    base = ranges[0][0]
    in_pool = pool_membership(ranges)

    names = {p.untyped_storage().data_ptr(): name for name, p in model.named_parameters() if p.device.type == device}
    # a buffer vLLM puts back whole is left to it; one that is a view into a parameter's storage (Mamba2's
    # conv_weights of conv1d.weight) or covers only part of its storage is not: the storage is carried
    buffers = {b.untyped_storage().data_ptr() for _, b in model.named_buffers()
               if b.device.type == device and b.untyped_storage().data_ptr() not in names
               and b.data_ptr() == b.untyped_storage().data_ptr()
               and b.numel() * b.element_size() == b.untyped_storage().nbytes()}
    found: dict[int, Any] = {}
    with warnings.catch_warnings():  # some objects warn when their type is asked (deprecated aliases)
        warnings.simplefilter("ignore")
        for obj in _all_objects():
            try:
                if not isinstance(obj, torch.Tensor) or obj.device.type != device:
                    continue
                storage = obj.untyped_storage()
                ptr, nbytes = storage.data_ptr(), storage.nbytes()
            except Exception:  # an object that is not a real tensor (a fake tensor of torch.compile's tracing)
                continue
            if nbytes and ptr not in buffers and in_pool(ptr) and nbytes > found.get(ptr, (0, None))[0]:
                found[ptr] = (nbytes, obj)
    named: list[tuple[str, Any]] = []
    end = 0
    for ptr in sorted(found):
        nbytes, tensor = found[ptr]
        if ptr < end:
            raise ValueError(f"two tensors of the weights pool overlap at {ptr - base:#x}")
        end = ptr + nbytes
        unnamed = f"tensor@{ptr - base:#x} {str(tensor.dtype).removeprefix('torch.')}{list(tensor.shape)}"
        named.append((names.get(ptr, unnamed), storage_view(tensor)))
    return named


def _all_objects() -> list[Any]:
    """Every object the garbage collector tracks, those vLLM froze after loading (gc.freeze: then
    gc.get_objects leaves them out) included; they are frozen again afterwards."""
    import gc

    frozen, enabled = gc.get_freeze_count(), gc.isenabled()
    if frozen:
        gc.collect()  # what is garbage now must not be frozen with the rest below (frozen objects are skipped)
    gc.disable()  # no collection of the unfrozen heap (a full one takes seconds) while it is unfrozen
    if frozen:
        gc.unfreeze()
    try:
        return gc.get_objects()
    finally:
        if frozen:
            gc.freeze()
        if enabled:
            gc.enable()


CHECKSUM_WORDS = 1 << 22  # int32 words summed at a time (as int64, weighted: ~100 MB of scratch on the device)


def fingerprint(named: list[tuple[str, Any]]) -> dict[str, int]:
    """A checksum per tensor, to name what did not come back: over its whole storage, int32 word
    by word, each word weighted by its position (1 to 251, repeating), each chunk of
    CHECKSUM_WORDS by its index too, so that moved bytes (swapped LoRA slots) count as changed;
    trailing bytes added last. Taken only at capture."""
    import torch

    sums = {}
    for name, tensor in named:
        flat = storage_view(tensor)
        words = flat[: flat.numel() // 4 * 4].view(torch.int32)
        total = 0
        for index, start in enumerate(range(0, words.numel(), CHECKSUM_WORDS)):
            chunk = words[start:start + CHECKSUM_WORDS].to(torch.int64)
            weights = torch.arange(chunk.numel(), device=chunk.device, dtype=torch.int64) % 251 + 1
            total = (total + (index + 1) * int((chunk * weights).sum().item())) % (1 << 63)
        sums[name] = total + int(flat[words.numel() * 4:].sum().item())
    return sums


class WeightsFileExtension(TensorParallelExtension):
    """Methods added to vLLM's GPU worker; called with ``collective_rpc("vsnap_...")``. vsnap's one
    worker extension: the tensor-parallel methods (vllm_tp) are mixed in, under the name specs
    and images already carry."""

    def _vsnap_model(self) -> Any:
        return self.model_runner.get_model()  # type: ignore[attr-defined]

    def _vsnap_rank(self) -> int:
        return int(getattr(self, "rank", 0))

    def vsnap_save_weights(self, directory: str) -> dict[str, Any]:
        """Write the weights pool's tensors (pool_tensors) to DIRECTORY/rank<N>.bin (called while
        the weights are loaded); the worker keeps the views to refill after a wake."""
        start = time.monotonic()
        named = pool_tensors(self._vsnap_model())
        if not named:
            raise RuntimeError("the weights are not in vLLM's sleep allocator (is sleep mode on?)")
        os.makedirs(directory, mode=0o700, exist_ok=True)
        path = Path(directory) / file_name(self._vsnap_rank())
        with open(path, "wb") as f:
            for _, tensor in named:
                f.write(memoryview(tensor.cpu().numpy()))
            f.flush()
            os.fsync(f.fileno())
        self._vsnap_layout = layout(named)
        self._vsnap_targets = [t for _, t in named]
        self._vsnap_sums = fingerprint(named)
        parameters = sum(1 for name, _ in named if not name.startswith("tensor@"))
        others = sorted(((t.numel(), name) for name, t in named if name.startswith("tensor@")), reverse=True)
        return {"weights_bytes": float(path.stat().st_size), "weights_save_s": time.monotonic() - start,
                "tensors": float(len(named)), "parameter_storages": float(parameters),
                "other_bytes": float(sum(n for n, _ in others)),
                "largest_others": "; ".join(f"{name} {n / 1e6:.1f} MB" for n, name in others[:4])}

    def vsnap_start_loading_weights(self, directory: str) -> None:
        """Start streaming DIRECTORY/rank<N>.bin into the (awake, empty) weights pool in the
        background, so the KV cache can be woken meanwhile; vsnap_finish_loading_weights waits."""
        saved: list[Segment] | None = getattr(self, "_vsnap_layout", None)
        if saved is None:
            raise RuntimeError("no weights file was written by this process")
        held = {t.data_ptr(): t.numel() for t in self._vsnap_targets}
        in_pool = pool_membership(weights_pool_ranges())
        for name, p in self._vsnap_model().named_parameters():
            storage = p.untyped_storage()
            if p.is_cuda and in_pool(storage.data_ptr()) and held.get(storage.data_ptr()) != storage.nbytes():
                raise RuntimeError(f"the model's parameters changed since the weights file was written ({name})")
        path = Path(directory) / file_name(self._vsnap_rank())
        self.vsnap_unlock_weights_file(background=False)  # an earlier load's pages, if any (raises if they stay)
        locked: list[LockedPages] = []
        self._vsnap_locked = locked
        pool = ThreadPoolExecutor(max_workers=1)
        self._vsnap_loading = (pool, pool.submit(stream_into, path, saved, self._vsnap_targets,
                                                 unlock_later=locked.append))

    def vsnap_unlock_weights_file(self, background: bool) -> dict[str, float]:
        """Unlock the weights file's pages that the last load left locked (dma_into's
        unlock_later). A restore does it once the server serves, in a thread of its own,
        piece by piece (``background``: each unlock waits for the GPU's work in flight and holds
        the driver's lock, so it delays the next launch by a few milliseconds); before a sleep,
        and so before any checkpoint, it is done at once, after any background unlocking, and a
        piece the driver will not unlock fails the call (UnlockRefused): nothing is checkpointed
        with pages locked."""
        running: threading.Thread | None = getattr(self, "_vsnap_unlocking", None)
        if running is not None:
            running.join()
            self._vsnap_unlocking = None
        locked: list[LockedPages] = getattr(self, "_vsnap_locked", [])
        if not locked:
            return {}
        if not background:
            return _release_all(locked, 0.0)  # empties `locked`; raises with the refused pieces kept in it
        pieces = float(sum(p.pieces for p in locked))

        def unlock() -> None:  # the list stays the worker's until every piece is unlocked
            try:
                print(f"vsnap: weights file unlocked: {_release_all(locked, UNLOCK_PAUSE_S)}", flush=True)
            except UnlockRefused as refused:
                print(f"vsnap: {refused}", flush=True)

        self._vsnap_unlocking = threading.Thread(target=unlock, name="vsnap-unlock-weights", daemon=True)
        self._vsnap_unlocking.start()
        return {"unlocking_pieces": pieces}

    def vsnap_refresh_weights(self, directory: str) -> dict[str, float]:
        """Rewrite, in place, the file's pieces whose tensors changed since it was written (the
        oracle and the rehearsal between the save and the checkpoint move LoRA adapters between
        slots): the file must hold the pool as the image's CPU state expects it."""
        start = time.monotonic()
        named = list(zip((seg.name for seg in self._vsnap_layout), self._vsnap_targets))
        now = fingerprint(named)
        changed = [k for k, (seg, (name, tensor)) in enumerate(zip(self._vsnap_layout, named))
                   if now[name] != self._vsnap_sums.get(name)]
        if changed:
            fd = os.open(Path(directory) / file_name(self._vsnap_rank()), os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
            try:
                for k in changed:
                    data = memoryview(self._vsnap_targets[k].cpu().numpy())
                    if os.pwrite(fd, data, self._vsnap_layout[k].offset) != len(data):
                        raise OSError(f"short write refreshing {self._vsnap_layout[k].name}")
                os.fsync(fd)
            finally:
                os.close(fd)
            self._vsnap_sums = now
        return {"refreshed_tensors": float(len(changed)), "refresh_s": time.monotonic() - start}

    def vsnap_fingerprint(self) -> dict[str, int]:
        """Checksums of the parameters, the buffers and the weights file's tensors (while awake)."""
        model = self._vsnap_model()
        named = [(f"parameter {n}", p) for n, p in model.named_parameters() if p.is_cuda and p.numel()]
        named += [(f"buffer {n}", b) for n, b in model.named_buffers() if b.is_cuda and b.numel()]
        named += [(f"tensor {n}", t) for n, t in zip((s.name for s in getattr(self, "_vsnap_layout", [])),
                                                     getattr(self, "_vsnap_targets", []))]
        return fingerprint(named)

    def vsnap_finish_loading_weights(self) -> dict[str, float]:
        pool, future = self._vsnap_loading
        try:
            return future.result()
        finally:
            pool.shutdown()
            del self._vsnap_loading

    def vsnap_before_sleep(self) -> dict[str, float]:
        """Before vLLM's sleep: the CUDA graph pool is tagged to be unmapped with the KV cache."""
        return {"graph_pool_tagged_bytes": float(tag_graph_pool())}

    def vsnap_release_memory(self) -> dict[str, float]:
        """After vLLM's sleep, before a checkpoint: drop what the image need not carry (freed blocks
        of torch's cache, freed heap) and report what is left (device_memory_report).

        Not cuBLAS's workspaces (``torch._C._cuda_clearCublasWorkspaces()``, 67 MB on the 8B):
        captured CUDA graphs use them, and on the 8B the first request after a wake then hit an
        illegal memory access (H200, 2026-12-01; the tiny model happened to survive it)."""
        import torch

        torch.cuda.synchronize()
        start = _device_used()
        release_heap()  # first: a collected tensor's block can then be returned
        torch.cuda.empty_cache()
        stack: dict[str, float] = {}
        if os.environ.get(STACK_ENV) != "keep" and getattr(self, "_vsnap_stack_limit", None) is None:
            lowered = lower_stack_limit()  # not twice without a wake: the second would record 0
            if lowered is not None:
                self._vsnap_stack_limit, freed = lowered
                stack = {"stack_freed_bytes": float(freed)}
        return {**device_memory_report(), **stack, "freed_bytes": float(start - _device_used())}

    def vsnap_restore_stack_limit(self) -> dict[str, float]:
        """At a wake, before any kernel runs: the stack limit vsnap_release_memory lowered goes
        back to what it was when the CUDA graphs were captured (their kernels do not grow it)."""
        limit: int | None = getattr(self, "_vsnap_stack_limit", None)
        if limit is None:
            return {}
        result = set_stack_limit(limit)  # raises on a refusal: the value stays for the next try
        self._vsnap_stack_limit = None
        return result


def lower_stack_limit() -> tuple[int, int] | None:
    """Give back the context's per-thread stack reservation before the checkpoint: (the limit it
    had, the device bytes freed), or None where nothing was lowered.

    The CUDA context reserves stack for every thread the GPU can hold resident (1 KiB by default x
    2048 threads x 132 SMs on an H200: 277 MB of a bare context's 651 MB), and that memory is
    copied to the host by the CUDA checkpoint, written and read by CRIU, and copied back at every
    restore. Every wake sets the limit back before any kernel runs (set_stack_limit, through the
    worker's vsnap_restore_stack_limit), so the graphs replay with the stack they were captured
    with: lowered and left at 0, the 8B's rehearsal failed at its first request after the wake
    with "CUDA error: unspecified launch failure" (H200, vLLM 0.26, 2026-12-01; kernels replayed
    from CUDA graphs do not grow the stack as plain launches do). Put back, the 8B's rehearsal, two
    restores and an activation gave the oracle bit for bit, with 1033 to 1102 MB of device memory
    left at sleep instead of 1310, and the CUDA restore took 0.50 s instead of 0.61 (H200, session 10).

    On by default; ``VSNAP_CUDA_STACK=keep`` in the environment of `vsnap capture` turns it off.
    """
    try:
        from cuda.bindings import driver as cu
    except ImportError:
        return None
    limit = cu.CUlimit.CU_LIMIT_STACK_SIZE
    err, value = cu.cuCtxGetLimit(limit)
    if int(err) != 0 or not value:  # nothing to give back (or it was lowered already)
        return None
    before = _device_used()
    (result,) = cu.cuCtxSetLimit(limit, 0)
    if int(result) != 0:
        return None
    return int(value), before - _device_used()


def set_stack_limit(value: int) -> dict[str, float]:
    """Set the current context's per-thread stack limit back to ``value`` (the limit
    lower_stack_limit returned); a refusal is an error: kernels replayed from graphs could then
    fault, so the restore stops before its oracle."""
    import torch
    from cuda.bindings import driver as cu

    torch.cuda.synchronize()  # the device's primary context current on this thread
    start = time.monotonic()
    (result,) = cu.cuCtxSetLimit(cu.CUlimit.CU_LIMIT_STACK_SIZE, value)
    if int(result) != 0:
        raise RuntimeError(f"cuCtxSetLimit(CU_LIMIT_STACK_SIZE, {value}): {result}")
    return {"stack_restore_s": time.monotonic() - start}


def _device_used() -> int:
    import torch

    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return int(total - free)

if os.environ.get(GRAPH_POOL_ENV) == "sleep":  # set by the vllm adapter for its worker (spawned after)
    route_graph_pool_to_sleep_allocator()
