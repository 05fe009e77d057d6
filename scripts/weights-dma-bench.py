#!/usr/bin/env python3
"""How fast can a weights file in the page cache reach the GPU? (issue 11's "weights by DMA from
registered page-cache memory" lever; numbers go to docs/benchmarks/NOTES.md).

    python3 scripts/weights-dma-bench.py FILE [--gib 16] [--runs 2]

Writes FILE (GIB of bytes, kept in the page cache) unless it has that size, then times, each into
one GPU tensor of the file's size:
  stream      vsnap's buffered path (weights.copiers.buffered_into: threads read into pinned buffers, async copies)
  register    the file mmapped read-only, cuMemHostRegister of all of it, one copy, unregister
  pieces-N    N threads, each registering a piece of the mapping, copying it on its own stream,
              unregistering it (registration overlapped with other pieces' copies)
  dma-NxH     vsnap's weights.copiers.dma_into: N threads, each keeping up to H pieces locked
  later-NxH   the same with unlock_later (a restore's way): the load until every copy is done; the
              unlocking after it is timed apart
  pinned      a copy from host memory registered beforehand (the ceiling: what a standby holding
              its weights pinned would pay)
Prints one line per run and a table last; --json writes the table as JSON.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

PIECE = 512 << 20
DMA_SPLITS = [(4, 2), (4, 16), (2, 16), (1, 16)]  # dma_into's (threads, pieces held per thread)


def check(result: tuple, what: str) -> tuple:
    from cuda.bindings import driver as cu

    if result[0] != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{what}: {result[0]}")
    return result[1:]


def ensure_file(path: Path, nbytes: int) -> None:
    if path.exists() and path.stat().st_size == nbytes:
        return
    block = os.urandom(1 << 20) * 64
    with open(path, "wb") as out:
        for _ in range(nbytes // len(block)):
            out.write(block)


def warm(path: Path) -> None:
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(64 << 20)
        while f.readinto(buf):
            pass


def run_stream(path: Path, target) -> float:
    from vsnap.engine.adapters.vllm.weights.copiers import buffered_into
    from vsnap.engine.adapters.vllm.weights.layout import Segment

    size = path.stat().st_size  # the buffered path itself (stream_into takes dma_into first)
    return buffered_into(path, [Segment("all", 0, size, "torch.uint8", (size,))], [target])["weights_load_s"]


def run_dma(path: Path, target, reference, threads: int, held: int) -> tuple[float, str]:
    import torch

    from vsnap.engine.adapters.vllm.weights.copiers import dma_into
    from vsnap.engine.adapters.vllm.weights.layout import Segment

    size = path.stat().st_size
    target.zero_()
    torch.cuda.synchronize()
    result = dma_into(path, [Segment("all", 0, size, "torch.uint8", (size,))], [target], threads=threads, held=held)
    if not torch.equal(target, reference):
        raise RuntimeError("the GPU's copy differs from the file")
    return result["weights_load_s"], f"({result['weights_registered_pieces']:.0f} pieces locked)"


def run_dma_later(path: Path, target, reference, threads: int, held: int) -> tuple[float, float]:
    """dma_into with unlock_later (what a restore does): the load's time, then the unlocking's."""
    import torch

    from vsnap.engine.adapters.vllm.weights.copiers import dma_into
    from vsnap.engine.adapters.vllm.weights.layout import Segment

    size = path.stat().st_size
    target.zero_()
    torch.cuda.synchronize()
    handed: list = []
    result = dma_into(path, [Segment("all", 0, size, "torch.uint8", (size,))], [target], threads=threads, held=held,
                      unlock_later=handed.append)
    released = handed[0].release() if handed else {"unlock_s": 0.0}
    if not torch.equal(target, reference):
        raise RuntimeError("the GPU's copy differs from the file")
    return result["weights_load_s"], released["unlock_s"]


def run_register(path: Path, target) -> tuple[float, float, float]:
    import torch
    from cuda.bindings import driver as cu

    size = path.stat().st_size
    fd = os.open(path, os.O_RDONLY)
    m = mmap.mmap(fd, size, prot=mmap.PROT_READ, flags=mmap.MAP_SHARED)
    os.close(fd)
    addr = mapping_address(m)
    t0 = time.monotonic()
    check(cu.cuMemHostRegister(addr, size, cu.CU_MEMHOSTREGISTER_READ_ONLY), "cuMemHostRegister")
    t1 = time.monotonic()
    check(cu.cuMemcpyHtoD(target.data_ptr(), addr, size), "cuMemcpyHtoD")
    torch.cuda.synchronize()
    t2 = time.monotonic()
    check(cu.cuMemHostUnregister(addr), "cuMemHostUnregister")
    t3 = time.monotonic()
    _views.clear()
    m.close()
    return t1 - t0, t2 - t1, t3 - t0


def run_pieces(path: Path, target, threads: int, piece: int = PIECE) -> float:
    import itertools

    import torch
    from cuda.bindings import driver as cu

    size = path.stat().st_size
    fd = os.open(path, os.O_RDONLY)
    m = mmap.mmap(fd, size, prot=mmap.PROT_READ, flags=mmap.MAP_SHARED)
    os.close(fd)
    base = mapping_address(m)
    pieces = (size + piece - 1) // piece
    counter = itertools.count()
    dst = target.data_ptr()

    def worker() -> None:
        torch.cuda.set_device(target.device)
        stream = check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING), "cuStreamCreate")[0]
        registered: list[int] = []
        try:
            while (index := next(counter)) < pieces:
                lo = index * piece
                n = min(piece, size - lo)
                check(cu.cuMemHostRegister(base + lo, n, cu.CU_MEMHOSTREGISTER_READ_ONLY), "register")
                registered.append(base + lo)
                check(cu.cuMemcpyHtoDAsync(dst + lo, base + lo, n, stream), "copy")
            check(cu.cuStreamSynchronize(stream), "sync")
        finally:
            for addr in registered:
                cu.cuMemHostUnregister(addr)
            cu.cuStreamDestroy(stream)

    t0 = time.monotonic()
    with ThreadPoolExecutor(threads) as pool:
        for f in [pool.submit(worker) for _ in range(threads)]:
            f.result()
    seconds = time.monotonic() - t0
    _views.clear()
    m.close()
    return seconds


_views: list = []


def mapping_address(m: mmap.mmap) -> int:
    """The mapping's address (numpy reads it from a read-only buffer; the view is kept in _views
    until the mapping is closed)."""
    import numpy as np

    view = np.frombuffer(m, dtype=np.uint8)
    _views.append(view)
    return view.ctypes.data


def run_pinned(size: int, target) -> float:
    import torch

    host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    host.fill_(1)
    torch.cuda.synchronize()
    t0 = time.monotonic()
    target.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    seconds = time.monotonic() - t0
    del host
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("file", type=Path)
    parser.add_argument("--gib", type=float, default=16)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    import torch

    size = int(args.gib * (1 << 30)) // (64 << 20) * (64 << 20)
    ensure_file(args.file, size)
    warm(args.file)
    target = torch.empty(size, dtype=torch.uint8, device="cuda")
    with open(args.file, "rb") as f:  # what every dma_into run must leave on the GPU, by a plain pageable copy
        reference = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8).to("cuda")
    torch.cuda.synchronize()
    results: dict[str, list[float]] = {}

    def note(name: str, seconds: float, extra: str = "") -> None:
        results.setdefault(name, []).append(seconds)
        print(f"{name:12s} {seconds:7.3f} s  {size / seconds / 1e9:6.1f} GB/s {extra}", flush=True)

    def attempt(name: str, run) -> None:
        try:
            run()
        except Exception as exc:  # one way failing (e.g. the driver refusing a file mapping) must not hide the others
            print(f"{name:12s} failed: {type(exc).__name__}: {exc}", flush=True)

    def register() -> None:
        reg, copy, whole = run_register(args.file, target)
        note("register", whole, f"(register {reg:.3f} s, copy {copy:.3f} s, unregister {whole - reg - copy:.3f} s)")
        results.setdefault("register: register only", []).append(reg)
        results.setdefault("register: copy only", []).append(copy)

    for _ in range(args.runs):
        attempt("stream", lambda: note("stream", run_stream(args.file, target)))
        attempt("register", register)
        for threads in (4, 8):
            attempt(f"pieces-{threads}", lambda: note(f"pieces-{threads}", run_pieces(args.file, target, threads)))
        for threads, held in DMA_SPLITS:
            attempt(f"dma-{threads}x{held}",
                    lambda: note(f"dma-{threads}x{held}", *run_dma(args.file, target, reference, threads, held)))
        for threads, held in ((4, 16), (2, 16)):
            def later(threads: int = threads, held: int = held) -> None:
                load, unlock = run_dma_later(args.file, target, reference, threads, held)
                note(f"later-{threads}x{held}", load, f"(then unlocking {unlock:.3f} s)")
                results.setdefault(f"later-{threads}x{held}: unlocking", []).append(unlock)
            attempt(f"later-{threads}x{held}", later)
        attempt("pinned", lambda: note("pinned", run_pinned(size, target)))
    table = {name: statistics.median(v) for name, v in results.items()}
    print(f"\n{size / 1e9:.2f} GB, medians of {args.runs}:")
    for name, seconds in table.items():
        print(f"  {name:28s} {seconds:7.3f} s  {size / seconds / 1e9:6.1f} GB/s")
    if args.json:
        args.json.write_text(json.dumps({"bytes": size, "runs": results, "medians_s": table}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
