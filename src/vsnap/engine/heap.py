"""Shrink a process's heap before a checkpoint: CRIU writes every touched anonymous page."""

from __future__ import annotations

import ctypes
import gc
import time


def release_heap() -> float:
    """Collect garbage and return freed malloc memory to the kernel (where libc has malloc_trim).
    Returns the seconds the collection took (the size of the heap the collector scans)."""
    start = time.monotonic()
    gc.collect()
    collected_s = time.monotonic() - start
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    return collected_s


def freeze_heap() -> int:
    """Freeze every object the garbage collector tracks (after release_heap collected the garbage):
    a later full collection scans only what is made after. vLLM 0.32+ begins each wake_up with a
    full gc.collect() in the worker. vLLM's GPU worker freezes its heap at the end of its warm-up
    already, so with one rank this adds only what was made since (vsnap's save and rehearsal); a
    recapture of CUDA graphs (tensor parallelism) unfreezes it all, and there it matters. Returns
    how many objects are frozen."""
    gc.freeze()
    return gc.get_freeze_count()
