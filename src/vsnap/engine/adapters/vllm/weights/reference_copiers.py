"""Copying the weights pool back from a Plan (references.py): each extent from its file, the
model's safetensors files or the image's rank file, into the tensors. The same two ways as
copiers.py, with the same guarantees: dma_plan_into page-locks pieces of the read-only mapped
files in place and the GPU copies from them (at most ``held`` pieces locked per thread; on a
refusal or a failure nothing is left locked or mapped; ``unlock_later`` gets the pieces still
locked at the end, one LockedPages per file); buffered_plan_into reads pieces into pinned
buffers. stream_plan_into chooses, as stream_into does. The model's files are opened read-only
and never written.

A piece is a page-aligned range of one file: the ranges the extents read, rounded out to whole
pages and merged where they touch (two extents may read the same bytes: a model's tied
embeddings), cut every ``piece`` bytes. So no page is locked twice, and the file's bytes no
extent reads are not locked at all (a gap of a page or more)."""

from __future__ import annotations

import contextlib
import mmap
import os
import stat
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from .copiers import (
    CHUNK,
    DMA_ENV,
    DMA_PIECE,
    DMA_THREADS,
    THREADS,
    BufferedRead,
    LockedPages,
    RegistrationRefused,
    UnlockRefused,
    _overlaps,
    _PieceCopier,  # its threads' work (locking, unlocking, the end of a thread) is shared; only a piece differs
    copy_through_buffers,
    in_memory_file,
    pieces_held,
)
from .layout import Segment
from .references import IMAGE, Plan


@dataclass(frozen=True)
class Piece:
    """A range [lo, hi) of one source file (IMAGE or a model file's index) and the copies out of
    it: (file offset, target index, offset in the target, bytes)."""

    source: int
    lo: int
    hi: int
    copies: tuple[tuple[int, int, int, int], ...]


def plan_pieces(plan: Plan, segments: list[Segment], piece: int, align: int = 1) -> list[Piece]:
    """The plan's reads as pieces of at most ``piece`` bytes, each starting at a multiple of
    ``align`` (the page size, for page-locking) and never past its file's end; in file order."""
    if piece <= 0 or piece % align:
        raise ValueError(f"piece must be a positive multiple of {align}, not {piece}")
    starts = [s.offset for s in segments]
    pieces: list[Piece] = []
    for source in sorted({e.source for e in plan.extents}):
        size = plan.literal_bytes if source == IMAGE else plan.files[source].size
        extents = sorted((e for e in plan.extents if e.source == source), key=lambda e: e.offset)
        spans: list[list[Any]] = []  # [lo, hi, extents], page-rounded, merged where they touch
        for e in extents:
            lo, hi = e.offset // align * align, min(-(-(e.offset + e.nbytes) // align) * align, size)
            if spans and lo <= spans[-1][1]:
                spans[-1][1] = max(spans[-1][1], hi)
                spans[-1][2].append(e)
            else:
                spans.append([lo, hi, [e]])
        for span_lo, span_hi, inside in spans:
            for lo in range(span_lo, span_hi, piece):
                hi = min(lo + piece, span_hi)
                copies = []
                for e in inside:
                    a, b = max(lo, e.offset), min(hi, e.offset + e.nbytes)
                    if a >= b:
                        continue
                    pool = e.pool_offset + a - e.offset
                    for k, x, y in _overlaps(starts, segments, pool, pool + b - a):
                        copies.append((a + x - pool, k, x - segments[k].offset, y - x))
                pieces.append(Piece(source, lo, hi, tuple(copies)))
    return pieces


def source_path(plan: Plan, source: int, rank_path: Path) -> Path:
    return rank_path if source == IMAGE else plan.model_path(source)


def _open_source(plan: Plan, source: int, rank_path: Path) -> int:
    """The source file, read-only, checked to have the size the plan was made with. The rank file
    is opened as the weights file always is (no link followed); a model file as vLLM opens it (a
    model directory's files are often links: the trust model checks them, and their sha256)."""
    path = source_path(plan, source, rank_path)
    # O_NONBLOCK: a FIFO put in a file's place must not hang the load (it is refused below)
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (os.O_NOFOLLOW if source == IMAGE else 0)
    fd = os.open(path, flags)
    try:
        st = os.fstat(fd)
        size, want = st.st_size, plan.literal_bytes if source == IMAGE else plan.files[source].size
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{'' if source == IMAGE else 'model file '}{path} is not a regular file; the image's "
                             "weights plan reads a file there")
        if size != want:
            if source == IMAGE:
                raise ValueError(f"{path} has {size} bytes; the weights plan needs {want}")
            raise ValueError(f"model file {path} has {size} bytes; the image's weights plan needs {want} "
                             "(the model's files changed since the capture)")
        if source != IMAGE:
            with contextlib.suppress(OSError):  # start reading what the plan reads, if not in the page cache yet
                for e in plan.extents:
                    if e.source == source:
                        os.posix_fadvise(fd, e.offset, e.nbytes, os.POSIX_FADV_WILLNEED)
        return fd
    except BaseException:
        os.close(fd)
        raise


def _check(plan: Plan, rank_path: Path, segments: list[Segment], targets: list[Any]) -> int:
    """The plan is whole and fits the tensors and the rank file (even one it does not read)."""
    plan.check()
    total = segments[-1].offset + segments[-1].nbytes if segments else 0
    if total != plan.total_bytes or len(targets) != len(segments):
        raise ValueError(f"the weights plan covers {plan.total_bytes} bytes; the parameters need {total}")
    size = os.lstat(rank_path).st_size
    if size != plan.literal_bytes:
        raise ValueError(f"{rank_path} has {size} bytes; the weights plan needs {plan.literal_bytes}")
    return total


def dma_plan_into(plan: Plan, rank_path: Path, segments: list[Segment], targets: list[Any], *,
                  threads: int = DMA_THREADS, piece: int = DMA_PIECE, held: int | None = None,
                  unlock_later: Callable[[LockedPages], None] | None = None) -> dict[str, float]:
    """dma_into for a plan: each file the plan reads mapped read-only, its pieces page-locked in
    place and copied by the GPU. Raises RegistrationRefused where this path cannot run (the
    caller copies everything again its own way), RuntimeError for a copy the GPU fails, ValueError
    for a file of another size than the plan's."""
    if piece <= 0 or piece % mmap.PAGESIZE:
        raise ValueError(f"piece must be a positive multiple of the page size ({mmap.PAGESIZE}), not {piece}")
    if held is not None and held < 2:
        raise ValueError(f"held must be at least 2 (one piece copied while the next is locked), not {held}")
    total = _check(plan, rank_path, segments, targets)
    if not total:
        return {"weights_bytes": 0.0, "weights_load_s": 0.0, "weights_gb_per_s": 0.0, "weights_registered_pieces": 0.0}
    try:
        import numpy as np
        from cuda.bindings import driver as cu
    except ImportError as exc:
        raise RegistrationRefused(f"no cuda-bindings ({exc})") from None
    pieces = plan_pieces(plan, segments, piece, mmap.PAGESIZE)
    mapped: dict[int, tuple[mmap.mmap, Any]] = {}  # source: (its mapping, a uint8 view of it)
    in_memory: set[int] = set()  # sources whose pages stay in memory anyway (in_memory_file)
    try:
        for source in sorted({p.source for p in pieces}):
            fd = _open_source(plan, source, rank_path)
            try:
                if in_memory_file(fd):
                    in_memory.add(source)
                mapping = mmap.mmap(fd, os.fstat(fd).st_size, prot=mmap.PROT_READ, flags=mmap.MAP_SHARED)
            except OSError as exc:
                raise RegistrationRefused(f"{source_path(plan, source, rank_path)} cannot be mapped: "
                                          f"{exc.strerror}") from None
            finally:
                os.close(fd)
            mapped[source] = (mapping, np.frombuffer(mapping, dtype=np.uint8))
    except BaseException:
        _unmap(mapped)
        raise
    bases = {source: int(view.ctypes.data) for source, (_, view) in mapped.items()}
    ordinal = targets[0].device.index or 0
    workers = min(threads, len(pieces))
    try:
        copier = _PlanPieceCopier(cu, pieces, bases, {s: source_path(plan, s, rank_path) for s in mapped},
                                  [t.data_ptr() for t in targets], [s.name for s in segments], ordinal,
                                  held=pieces_held(held, workers, piece, pieces=len(pieces),
                                                   reclaimable=sum(p.source not in in_memory for p in pieces)),
                                  keep_locked=unlock_later is not None)
    except BaseException:
        _unmap(mapped)
        raise
    start = time.monotonic()
    try:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            futures = [pool.submit(copier.run) for _ in range(workers)]
        errors = [f.exception() for f in futures if f.exception() is not None]
        if errors:  # a failed copy before a refusal: it is the one to report
            raise next((e for e in errors if not isinstance(e, RegistrationRefused)), errors[0])
        done = sum(f.result() for f in futures)
    except BaseException:  # every thread has ended: what they kept locked is unlocked, every file unmapped
        _release_each(_locked_per_file(ordinal, mapped, copier.kept))
        raise
    seconds = time.monotonic() - start
    locked = _locked_per_file(ordinal, mapped, copier.kept)  # one LockedPages per mapped file
    if unlock_later is None:
        _release_each(locked)
    else:
        handed = 0
        try:
            for pages in locked:
                unlock_later(pages)
                handed += 1
        except BaseException:
            _release_each(locked[handed:])
            raise
    return {"weights_bytes": float(total), "weights_load_s": seconds, "weights_gb_per_s": total / max(seconds, 1e-9) / 1e9,
            "weights_registered_pieces": float(done), "weights_unlocked_later_pieces": float(len(copier.kept)),
            "weights_referenced_bytes": float(plan.referenced_bytes)}


class _PlanPieceCopier(_PieceCopier):
    """_PieceCopier's threads over a plan's pieces: piece ``index`` is ``pieces[index]``, in the
    mapping of its file (``bases``)."""

    def __init__(self, cu: Any, pieces: list[Piece], bases: dict[int, int], paths: dict[int, Path],
                 addresses: list[int], names: list[str], ordinal: int, *, held: int, keep_locked: bool) -> None:
        super().__init__(cu, Path(), [], [], addresses, ordinal, base=0, total=0, piece=1, pieces=len(pieces),
                         held=held, keep_locked=keep_locked)
        self.plan_pieces, self.bases, self.paths, self.names = pieces, bases, paths, names

    def _copy_piece(self, index: int, locked: list[tuple[int, Any]], stream: Any) -> None:
        cu, ok = self.cu, self.ok
        p = self.plan_pieces[index]
        base = self.bases[p.source]
        (err,) = cu.cuMemHostRegister(base + p.lo, p.hi - p.lo, cu.CU_MEMHOSTREGISTER_READ_ONLY)
        if err != ok:
            raise RegistrationRefused(f"cuMemHostRegister of {self.paths[p.source]} at byte {p.lo}: {err}")
        err, event = cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING)
        locked.append((base + p.lo, event if err == ok else None))
        if err != ok:
            raise RegistrationRefused(f"no CUDA event: {err}")
        for file_offset, k, target_offset, nbytes in p.copies:
            (err,) = cu.cuMemcpyHtoDAsync(self.addresses[k] + target_offset, base + file_offset, nbytes, stream)
            if err != ok:
                raise RuntimeError(f"copying {self.names[k]} to the GPU: {err}")
        (err,) = cu.cuEventRecord(event, stream)
        if err != ok:
            raise RuntimeError(f"copying the weights to the GPU: {err}")


def _locked_per_file(ordinal: int, mapped: dict[int, tuple[mmap.mmap, Any]],
                     kept: list[tuple[int, Any]]) -> list[LockedPages]:
    """One LockedPages per mapped file, holding the kept pieces that lie in its mapping."""
    result = []
    for mapping, view in mapped.values():
        base = int(view.ctypes.data)
        mine = [(address, event) for address, event in kept if base <= address < base + len(mapping)]
        result.append(LockedPages(ordinal, mapping, view, mine))
    mapped.clear()
    return result


def _release_each(locked: list[LockedPages]) -> None:
    """Release every one (each unlocks its pieces and unmaps its file), even after one fails;
    then raise the first UnlockRefused."""
    refused: UnlockRefused | None = None
    for pages in locked:
        try:
            pages.release()
        except UnlockRefused as exc:
            refused = refused or exc
    if refused is not None:
        raise refused


def _unmap(mapped: dict[int, tuple[mmap.mmap, Any]]) -> None:
    """Unmap files of which nothing was locked yet (the view first: a mapping with a view cannot close)."""
    while mapped:
        _, (mapping, view) = mapped.popitem()
        del view
        mapping.close()


def buffered_plan_into(plan: Plan, rank_path: Path, segments: list[Segment], targets: list[Any], *,
                       threads: int = THREADS, chunk: int = CHUNK) -> dict[str, float]:
    """buffered_into for a plan: threads read pieces of the files into host buffers (pinned for
    CUDA targets, copied asynchronously) and copy them into the targets (copiers.copy_through_buffers)."""
    total = _check(plan, rank_path, segments, targets)
    pieces = plan_pieces(plan, segments, chunk)
    fds: dict[int, int] = {}
    try:
        for source in sorted({p.source for p in pieces}):
            fds[source] = _open_source(plan, source, rank_path)
        reads = [BufferedRead(fds[p.source], p.lo, p.hi - p.lo,
                              tuple((file_offset - p.lo, k, target_offset, nbytes)
                                    for file_offset, k, target_offset, nbytes in p.copies))
                 for p in pieces]
        seconds = copy_through_buffers(reads, targets, threads=threads, chunk=chunk)
    finally:
        for fd in fds.values():
            os.close(fd)
    return {"weights_bytes": float(total), "weights_load_s": seconds, "weights_gb_per_s": total / max(seconds, 1e-9) / 1e9,
            "weights_referenced_bytes": float(plan.referenced_bytes)}


def stream_plan_into(plan: Plan, rank_path: Path, segments: list[Segment], targets: list[Any], *,
                     threads: int = THREADS, chunk: int = CHUNK,
                     unlock_later: Callable[[LockedPages], None] | None = None) -> dict[str, float]:
    """stream_into for a plan: CUDA targets by dma_plan_into unless DMA_ENV is "0", through pinned
    buffers where CUDA refuses it; CPU targets by plain copies."""
    if targets and targets[0].device.type == "cuda" and os.environ.get(DMA_ENV) != "0":
        try:
            return dma_plan_into(plan, rank_path, segments, targets, unlock_later=unlock_later)
        except RegistrationRefused as refused:
            warnings.warn(f"vsnap: {refused}; copying through pinned buffers", stacklevel=1)
            return {**buffered_plan_into(plan, rank_path, segments, targets, threads=threads, chunk=chunk),
                    "weights_dma_refused": 1.0}
    return buffered_plan_into(plan, rank_path, segments, targets, threads=threads, chunk=chunk)
