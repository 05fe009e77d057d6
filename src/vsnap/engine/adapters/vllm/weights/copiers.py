"""Copying the weights file into the tensors: by default the GPU copies straight from the page
cache, page-locked piece by piece in place (dma_into, its threads' work in _PieceCopier); the
pieces still locked once every copy is done may be handed on as LockedPages, unlocked later
(release); where CUDA refuses that, several threads read pieces of the file into pinned host
buffers and copy each to its tensor with an asynchronous host-to-device copy while the next piece
is read (buffered_into). stream_into chooses."""

from __future__ import annotations

import bisect
import contextlib
import functools
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

from .layout import Segment

CHUNK = 32 << 20  # bytes read and copied at a time by one thread
THREADS = 8  # readers (H200 host, 8B: 8 read 17.6 GB/s from the page cache, 12 read 15.6 GB/s); each owns two pinned buffers (one read into while the other is copied)
DMA_THREADS = 4  # dma_into's threads (H200 host, 17.2 GB: 4 and 8 both ~26 GB/s, bound by page-locking)
DMA_PIECE = 512 << 20  # bytes page-locked and copied at a time by one of them
DMA_HELD = 16  # pieces each thread keeps locked before it unlocks its oldest, where the host's memory cannot take them all (pieces_held)
UNLOCK_PAUSE_S = 0.02  # between two pieces unlocked once the server serves: its launches take the driver's lock between them
DMA_ENV = "VSNAP_WEIGHTS_DMA"  # "0" in the capture's environment: the buffered path only (default: dma_into first)


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


MEMINFO = Path("/proc/meminfo")
# filesystems whose pages stay in memory whatever is locked, where the host has no swap
IN_MEMORY_FILESYSTEMS = {0x01021994: "tmpfs", 0x858458F6: "ramfs", 0x958458F6: "hugetlbfs"}


def _meminfo_bytes(field: str, meminfo: Path) -> int | None:
    try:
        fields = dict(line.split(":", 1) for line in meminfo.read_text().splitlines() if ":" in line)
        return int(fields[field].split()[0]) * 1024
    except (OSError, KeyError, ValueError, IndexError):
        return None


def held_within_memory(held: int, threads: int, piece: int, meminfo: Path = MEMINFO) -> int:
    """``held``, lowered (to 2 at least) so that every thread's locked pieces together stay within
    half of the host's MemAvailable: locked page-cache pages cannot be reclaimed until unlocked."""
    available = _meminfo_bytes("MemAvailable", meminfo)
    if available is None:
        return 2  # unknown: the least
    return max(2, min(held, available // 2 // max(threads * piece, 1)))


def pieces_held(held: int | None, threads: int, piece: int, *, pieces: int, reclaimable: int,
                meminfo: Path = MEMINFO) -> int:
    """How many pieces each of ``threads`` threads keeps locked while the copies run. A ``held``
    the caller gives is a cap, lowered by held_within_memory. Without one (None): all of them when
    the ``reclaimable`` ones among the ``pieces`` (those whose pages the kernel could otherwise
    reclaim: not in_memory_file's) fit in half of MemAvailable and in DMA_HELD per thread at once,
    else DMA_HELD within held_within_memory's bound. RLIMIT_MEMLOCK does not apply: the driver
    pins the pages without counting them against it.

    Unlocking a piece while the others are locked and copied takes the driver's lock they need: a
    70B-class model's ~145 pieces, 14 held per thread for want of memory, loaded at 20.5 GB/s where
    an 8B's 32, none unlocked during its copies, load at 30 to 34 (NOTES.md, session 18; the cause
    as far as measured, not yet proven)."""
    if held is not None:
        return held_within_memory(held, threads, piece, meminfo)
    available = _meminfo_bytes("MemAvailable", meminfo)
    # the page cache a restore may keep from being reclaimed: half of MemAvailable, and no more than
    # before (DMA_HELD per thread; concurrent restores each count the same MemAvailable)
    if available is not None and reclaimable * piece <= available // 2 and reclaimable <= threads * DMA_HELD:
        return max(2, pieces)  # as many as there are: the threads share them unevenly, none may unlock
    return held_within_memory(DMA_HELD, threads, piece, meminfo)


def in_memory_file(fd: int, meminfo: Path = MEMINFO) -> bool:
    """Whether ``fd``'s pages stay in memory whatever is locked: a tmpfs, ramfs or hugetlbfs file
    on a host without swap (SwapTotal 0). Page-locking them takes nothing the kernel could
    reclaim from the rest of the host. False where either cannot be told."""
    if _meminfo_bytes("SwapTotal", meminfo) != 0:
        return False
    return _filesystem_magic(fd) in IN_MEMORY_FILESYSTEMS


def _filesystem_magic(fd: int) -> int | None:
    """fstatfs(2)'s f_type of ``fd``'s filesystem (os has only statvfs, which has no type)."""
    import ctypes
    import struct

    fstatfs = _fstatfs()
    buffer = ctypes.create_string_buffer(256)  # struct statfs is 120 bytes on 64-bit Linux; f_type first
    if fstatfs is None or fstatfs(fd, buffer) != 0:
        return None
    return int(struct.unpack_from("L", buffer.raw, 0)[0]) & 0xFFFFFFFF  # the magics are 32-bit; f_type a word


@functools.cache
def _fstatfs() -> Any | None:
    """The C library's fstatfs(2); None where it has none."""
    import ctypes

    try:
        return ctypes.CDLL(None, use_errno=True).fstatfs
    except (OSError, AttributeError):
        return None


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
             piece: int = DMA_PIECE, held: int | None = None,
             unlock_later: Callable[[LockedPages], None] | None = None) -> dict[str, float]:
    """Copy the file's bytes into CUDA ``targets`` straight from the page cache: the file mapped
    read-only, each piece page-locked in place (cuMemHostRegister) and copied by the GPU's copy
    engine, no host-side copy at all. Threads lock pieces while others' copies run. Each thread
    holds at most ``held`` pieces locked (it waits for its oldest piece's copies and unlocks it
    before it locks another). Without ``held``, pieces_held decides: every piece where the host's
    memory allows it, fewer where it is short. So at most held x threads x piece bytes of the page
    cache are locked at once; the rest are unlocked once every copy is done. The driver's locking
    and unlocking appear to share one
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
    if held is not None and held < 2:
        raise ValueError(f"held must be at least 2 (one piece copied while the next is locked), not {held}")
    total = segments[-1].offset + segments[-1].nbytes if segments else 0
    if not total:
        return {"weights_bytes": 0.0, "weights_load_s": 0.0, "weights_gb_per_s": 0.0, "weights_registered_pieces": 0.0}
    try:
        import numpy as np
        from cuda.bindings import driver as cu
    except ImportError as exc:
        raise RegistrationRefused(f"no cuda-bindings ({exc})") from None
    starts = [s.offset for s in segments]
    addresses = [t.data_ptr() for t in targets]
    ordinal = targets[0].device.index or 0
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        if os.fstat(fd).st_size != total:
            raise ValueError(f"{path} has {os.fstat(fd).st_size} bytes; the parameters need {total}")
        in_memory = in_memory_file(fd)
        try:
            mapping = mmap.mmap(fd, total, prot=mmap.PROT_READ, flags=mmap.MAP_SHARED)
        except OSError as exc:
            raise RegistrationRefused(f"{path} cannot be mapped: {exc.strerror}") from None
    finally:
        os.close(fd)
    view = np.frombuffer(mapping, dtype=np.uint8)
    pieces = (total + piece - 1) // piece
    workers = min(threads, pieces)
    copier = _PieceCopier(cu, path, segments, starts, addresses, ordinal, base=int(view.ctypes.data), total=total,
                          piece=piece, pieces=pieces,
                          held=pieces_held(held, workers, piece, pieces=pieces, reclaimable=0 if in_memory else pieces),
                          keep_locked=unlock_later is not None)
    start = time.monotonic()
    locked_pages = LockedPages(ordinal, mapping, view, copier.kept)
    del view
    try:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            futures = [pool.submit(copier.run) for _ in range(workers)]
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
            "weights_registered_pieces": float(done), "weights_unlocked_later_pieces": float(len(copier.kept))}


class _PieceCopier:
    """The work of dma_into's threads over one mapped file (``base``: its address): each thread
    runs run(), which takes the next piece (a shared counter), page-locks it and issues its copies
    on a stream of its own, until no piece is left or one thread has failed (``stop``). The pieces
    a thread still holds locked at its end go to ``kept``: for unlock_later (``keep_locked``, when
    no thread failed), else those the driver would not unlock."""

    def __init__(self, cu: Any, path: Path, segments: list[Segment], starts: list[int], addresses: list[int],
                 ordinal: int, *, base: int, total: int, piece: int, pieces: int, held: int,
                 keep_locked: bool) -> None:
        self.cu, self.ok = cu, cu.CUresult.CUDA_SUCCESS
        self.path, self.segments, self.starts, self.addresses, self.ordinal = path, segments, starts, addresses, ordinal
        self.base, self.total, self.piece, self.pieces, self.held = base, total, piece, pieces, held
        self.keep_locked = keep_locked
        self.counter = itertools.count()
        self.stop = threading.Event()  # one thread's failure ends the others' work at their next piece
        self.kept: list[tuple[int, Any]] = []  # pieces left locked for unlock_later, their copies done
        self.kept_lock = threading.Lock()

    def run(self) -> int:
        """One thread's work; returns how many pieces it copied."""
        cu, ok = self.cu, self.ok
        err, device = cu.cuDeviceGet(self.ordinal)
        err2, context = cu.cuDevicePrimaryCtxRetain(device) if err == ok else (err, None)
        if err2 != ok:
            raise RegistrationRefused(f"no CUDA context for device {self.ordinal}: {err2}")
        locked: list[tuple[int, Any]] = []  # (address, event after its copies), oldest first
        stream = None
        try:
            (err,) = cu.cuCtxSetCurrent(context)  # the primary context torch uses, on this thread
            err2, stream = cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING) if err == ok else (err, None)
            if err2 != ok:
                raise RegistrationRefused(f"no CUDA stream: {err2}")
            done = 0
            while not self.stop.is_set() and (index := next(self.counter)) < self.pieces:
                if len(locked) == self.held:  # the oldest piece's copies must be done before it is unlocked
                    self._unlock_oldest(locked)
                self._copy_piece(index, locked, stream)
                done += 1
            (err,) = cu.cuStreamSynchronize(stream)
            if err != ok:
                raise RuntimeError(f"copying the weights to the GPU: {err}")
            return done
        except BaseException:
            self.stop.set()
            raise
        finally:
            self._end(locked, stream, device)

    def _unlock_oldest(self, locked: list[tuple[int, Any]]) -> None:
        cu = self.cu
        address, event = locked.pop(0)
        (err,) = cu.cuEventSynchronize(event)
        if not _unlock(cu, address, event):
            with self.kept_lock:
                self.kept.append((address, None))  # still locked: release() tries again, and says so
        if err != self.ok:
            raise RuntimeError(f"copying the weights to the GPU: {err}")

    def _copy_piece(self, index: int, locked: list[tuple[int, Any]], stream: Any) -> None:
        """Page-lock piece ``index`` (it joins ``locked``), issue its copies, then record its event."""
        cu, ok, base, segments = self.cu, self.ok, self.base, self.segments
        lo = index * self.piece
        hi = min(lo + self.piece, self.total)
        (err,) = cu.cuMemHostRegister(base + lo, hi - lo, cu.CU_MEMHOSTREGISTER_READ_ONLY)
        if err != ok:
            raise RegistrationRefused(f"cuMemHostRegister of {self.path} at byte {lo}: {err}")
        err, event = cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING)
        locked.append((base + lo, event if err == ok else None))
        if err != ok:
            raise RegistrationRefused(f"no CUDA event: {err}")
        for k, a, b in _overlaps(self.starts, segments, lo, hi):
            (err,) = cu.cuMemcpyHtoDAsync(self.addresses[k] + a - segments[k].offset, base + a, b - a, stream)
            if err != ok:
                raise RuntimeError(f"copying {segments[k].name} to the GPU: {err}")
        (err,) = cu.cuEventRecord(event, stream)
        if err != ok:
            raise RuntimeError(f"copying the weights to the GPU: {err}")

    def _end(self, locked: list[tuple[int, Any]], stream: Any, device: Any) -> None:
        """A thread's end, after success or failure: its pieces kept locked for unlock_later or
        unlocked (those the driver refuses kept), its stream destroyed, its context released."""
        cu = self.cu
        if stream is not None:
            cu.cuStreamSynchronize(stream)  # no copy may still read a piece once it is unlocked
        still = locked if self.keep_locked and not self.stop.is_set() else [
            (address, None) for address, event in locked if not _unlock(cu, address, event)]
        with self.kept_lock:
            self.kept.extend(still)
        if stream is not None:
            cu.cuStreamDestroy(stream)
        cu.cuDevicePrimaryCtxRelease(device)


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


def release_all(locked: list[LockedPages], pause_s: float) -> dict[str, float]:
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
    total = segments[-1].offset + segments[-1].nbytes if segments else 0
    starts = [s.offset for s in segments]
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        if size != total:
            raise ValueError(f"{path} has {size} bytes; the parameters need {total}")
        reads = [BufferedRead(fd, lo, min(chunk, total - lo),
                              tuple((a - lo, k, a - segments[k].offset, b - a)
                                    for k, a, b in _overlaps(starts, segments, lo, min(lo + chunk, total))))
                 for lo in range(0, total, chunk)]
        seconds = copy_through_buffers(reads, targets, threads=threads, chunk=chunk)
    finally:
        os.close(fd)
    return {"weights_bytes": float(total), "weights_load_s": seconds, "weights_gb_per_s": total / max(seconds, 1e-9) / 1e9}


@dataclass(frozen=True)
class BufferedRead:
    """One read of copy_through_buffers: ``nbytes`` of ``fd`` from ``offset`` (at most one buffer),
    and the copies out of it: (offset in the read, target index, offset in the target, bytes)."""

    fd: int
    offset: int
    nbytes: int
    copies: tuple[tuple[int, int, int, int], ...]


def copy_through_buffers(reads: list[BufferedRead], targets: list[Any], *, threads: int = THREADS,
                         chunk: int = CHUNK) -> float:
    """The reads done by up to ``threads`` threads, each with two host buffers of ``chunk`` bytes
    (pinned for CUDA targets: one is read into while the other's asynchronous copies run), reads
    handed out in order; the seconds it took. buffered_into's and the weights plan's
    (reference_copiers.buffered_plan_into) one mechanism."""
    import torch

    counter = itertools.count()  # next() is atomic under the GIL: reads handed out in order
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
                if index >= len(reads):
                    break
                slot, read = turn % 2, reads[index]
                if pending[slot] is not None:
                    pending[slot].synchronize()  # that buffer's last copy is done
                buffer = buffers[slot]
                _read_into(read.fd, buffer.view[:read.nbytes], read.offset)
                with torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
                    for at, k, target_offset, nbytes in read.copies:
                        targets[k][target_offset:target_offset + nbytes].copy_(buffer.tensor[at:at + nbytes],
                                                                               non_blocking=cuda)
                    if cuda:
                        pending[slot] = torch.cuda.Event()
                        pending[slot].record(stream)
            if stream is not None:
                stream.synchronize()
        finally:
            for buffer in buffers:
                buffer.close()

    with ThreadPoolExecutor(max_workers=threads) as pool:
        for future in [pool.submit(reader) for _ in range(min(threads, max(len(reads), 1)))]:
            future.result()
    return time.monotonic() - start
