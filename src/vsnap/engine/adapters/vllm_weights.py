"""The model's weights as one flat file per rank, written at capture, streamed back at restore.

vLLM's own reload after sleep level 2 runs its model loader again: safetensors through pageable
copies and the model's weight-loading code, about 6 GB/s on an H200. This file holds the
parameters exactly as they sit on the GPU once loaded and processed (one contiguous run of bytes
per parameter, in ``named_parameters()`` order), so a restore only has to move bytes: several
threads read pieces of the file into pinned host buffers and copy each to its parameter with an
asynchronous host-to-device copy while the next piece is read.

``WeightsFileExtension`` is mixed into vLLM's GPU worker (vLLM's ``worker_extension_cls``); the
engine calls its methods through ``collective_rpc``. The layout (names, sizes, dtypes, shapes) is
kept in the worker's memory, which the CRIU image carries: a restore checks the parameters still
have that layout before it copies a byte.
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import mmap
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..heap import release_heap

CHUNK = 32 << 20  # bytes read and copied at a time by one thread
THREADS = 8  # readers (H200 host, 8B: 8 read 17.6 GB/s from the page cache, 12 read 15.6 GB/s); each owns two pinned buffers (one read into while the other is copied)
EXTENSION = f"{__name__}.WeightsFileExtension"


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


def stream_into(path: Path, segments: list[Segment], targets: list[Any], *, threads: int = THREADS,
                chunk: int = CHUNK) -> dict[str, float]:
    """Copy the file's bytes into ``targets`` (flat uint8 tensors, one per segment; CUDA tensors get
    pinned buffers and asynchronous copies, CPU ones plain copies)."""
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
                        first = bisect.bisect_right(starts, lo) - 1
                        for k in range(max(first, 0), len(segments)):
                            seg = segments[k]
                            a, b = max(lo, seg.offset), min(lo + n, seg.offset + seg.nbytes)
                            if a >= lo + n:
                                break
                            if a < b:
                                targets[k][a - seg.offset:b - seg.offset].copy_(buffer.tensor[a - lo:b - lo],
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
            for future in [pool.submit(reader) for _ in range(min(threads, max(chunks, 1)))]:
                future.result()
        seconds = time.monotonic() - start
    finally:
        os.close(fd)
    return {"weights_bytes": float(total), "weights_load_s": seconds, "weights_gb_per_s": total / max(seconds, 1e-9) / 1e9}


class WeightsFileExtension:
    """Methods added to vLLM's GPU worker; called with ``collective_rpc("vsnap_...")``."""

    def _vsnap_parameters(self) -> list[tuple[str, Any]]:
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        return [(name, p) for name, p in model.named_parameters() if p.numel() > 0]

    def _vsnap_rank(self) -> int:
        return int(getattr(self, "rank", 0))

    def vsnap_save_weights(self, directory: str) -> dict[str, float]:
        """Write every parameter's bytes to DIRECTORY/rank<N>.bin (called while the weights are loaded)."""
        start = time.monotonic()
        named = self._vsnap_parameters()
        segments = layout(named)
        os.makedirs(directory, mode=0o700, exist_ok=True)
        path = Path(directory) / file_name(self._vsnap_rank())
        with open(path, "wb") as f:
            for _, tensor in named:
                f.write(memoryview(flat_bytes(tensor).cpu().numpy()))
            f.flush()
            os.fsync(f.fileno())
        self._vsnap_layout = segments
        return {"weights_bytes": float(path.stat().st_size), "weights_save_s": time.monotonic() - start}

    def vsnap_start_loading_weights(self, directory: str) -> None:
        """Start streaming DIRECTORY/rank<N>.bin into the (awake, empty) parameters in the
        background, so the KV cache can be woken meanwhile; vsnap_finish_loading_weights waits."""
        saved: list[Segment] | None = getattr(self, "_vsnap_layout", None)
        if saved is None:
            raise RuntimeError("no weights file was written by this process")
        named = self._vsnap_parameters()
        now = layout(named)
        if now != saved:
            changed = next((a.name for a, b in zip(saved, now) if a != b), f"{len(saved)} vs {len(now)} parameters")
            raise RuntimeError(f"the model's parameters changed since the weights file was written ({changed})")
        path = Path(directory) / file_name(self._vsnap_rank())
        pool = ThreadPoolExecutor(max_workers=1)
        self._vsnap_loading = (pool, pool.submit(stream_into, path, now, [flat_bytes(t) for _, t in named]))

    def vsnap_finish_loading_weights(self) -> dict[str, float]:
        pool, future = self._vsnap_loading
        try:
            return future.result()
        finally:
            pool.shutdown()
            del self._vsnap_loading

    def vsnap_release_memory(self) -> dict[str, float]:
        """Before a checkpoint: drop what the image need not carry (cached GPU blocks, freed heap)."""
        import torch

        torch.cuda.empty_cache()
        release_heap()
        free, total = torch.cuda.mem_get_info()
        stats = torch.cuda.memory_stats()
        return {"gpu_used_bytes": float(total - free),  # the whole GPU: every process
                "torch_allocated_bytes": float(stats.get("allocated_bytes.all.current", 0)),
                "torch_reserved_bytes": float(stats.get("reserved_bytes.all.current", 0))}
