"""Why the weights load slower on vLLM 0.33 than on 0.26 (session 16's reading, docs/benchmarks/NOTES.md):
vsnap's restore order replayed on vLLM's own sleep allocator with vsnap's dma_into, no model.

    PYTHONPATH=/tmp/site033 python scripts/wake-dma-probe.py WEIGHTS_FILE     # on the GPU machine

The restore wakes the weights' pool, starts streaming the weights file into it (dma_into, threads
that page-lock and copy), then wakes the KV cache beside it. Hypotheses: (A) 0.33 backs the whole KV
cache with one allocation, mapped in one call that holds the GIL while the copy threads need it
(0.26: one per layer); (B) 0.33's wake_up starts with gc.collect() and empty_cache(), both holding
the GIL; (D) a 32-byte tensor new in 0.33 puts every later byte 32 bytes off its source's alignment.
Runs, one line each: the copy alone (KV cache woken first), alone shifted by 32 bytes, overlapping
the KV cache's wake as a restore does, the same with wake_up's gc.collect() a no-op, and one after
the other. Each line splits the wakes into gc, empty_cache and the maps.

Env: KV_GIB (50: the 8B's KV cache on an H200), KV_N (1 as 0.33 allocates it, 32 as 0.26 does),
HEAP (millions of unfrozen objects standing in for EngineCore's heap, 0), PIECE_MIB (dma_into's
piece, 512), GAP_S (between starting the copy and the KV cache's wake, 0.005).
"""

from __future__ import annotations

import gc
import os
import sys
import threading
import time
import types
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

RUNS = (("alone", True, 0), ("alone", True, 32), ("overlap", True, 0), ("overlap", False, 0), ("serial", True, 0))
ALIGN = 4096  # where the copy's first byte lands in the weights tensor


def main() -> int:
    import torch
    from vllm.device_allocator import cumem

    from vsnap.engine.adapters.vllm.weights.copiers import dma_into
    from vsnap.engine.adapters.vllm.weights.layout import Segment

    path = Path(sys.argv[1])
    size = path.stat().st_size
    kv_n = int(os.environ.get("KV_N", "1"))
    kv_bytes = int(float(os.environ.get("KV_GIB", "50")) * 2**30) // kv_n >> 21 << 21
    piece = int(os.environ.get("PIECE_MIB", "512")) << 20
    allocator = cumem.CuMemAllocator.get_instance()
    with allocator.use_memory_pool(tag="weights"):
        weights = torch.empty(size + ALIGN, dtype=torch.uint8, device="cuda")
    with allocator.use_memory_pool(tag="kv_cache"):
        kv = [torch.empty(kv_bytes, dtype=torch.uint8, device="cuda") for _ in range(kv_n)]
    heap = [[] for _ in range(int(float(os.environ.get("HEAP", "0")) * 1e6))]  # noqa: F841 (held: gc scans it)
    spent: dict[str, float] = {}

    def timed(name: str, call: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            start = time.monotonic()
            try:
                return call(*args, **kwargs)
            finally:
                spent[name] = spent.get(name, 0.0) + time.monotonic() - start
        return run

    torch.accelerator.empty_cache = timed("empty_cache", torch.accelerator.empty_cache)
    cumem.create_and_map = timed("map", cumem.create_and_map)

    def copy(shift: int, result: dict[str, float]) -> None:
        """The whole file into the weights tensor; with ``shift``, its first bytes go to a segment of
        their own so that the rest lands ``shift`` bytes off the alignment it has in the file."""
        segments = [Segment("rest", shift, size - shift, "torch.uint8", (size - shift,))]
        targets = [weights[ALIGN:ALIGN + size - shift]]
        if shift:
            segments.insert(0, Segment("head", 0, shift, "torch.uint8", (shift,)))
            targets.insert(0, weights[:shift])
        locked: list[Any] = []
        result.update(dma_into(path, segments, targets, piece=piece, unlock_later=locked.append))
        for pages in locked:
            pages.release()

    def shown(times: dict[str, float]) -> str:
        return ", ".join(f"{k} {v:.3f}" for k, v in sorted(times.items()))

    for mode, collect, shift in RUNS:
        allocator.sleep(offload_tags=())
        torch.cuda.synchronize()
        cumem.gc = types.SimpleNamespace(collect=timed("gc", gc.collect) if collect else (lambda: 0))
        spent.clear()
        result: dict[str, float] = {}
        start = time.monotonic()
        allocator.wake_up(None if mode == "alone" else ["weights"])
        woke = time.monotonic()
        waking_weights = dict(spent)
        spent.clear()
        if mode == "serial":
            allocator.wake_up(["kv_cache"])
        copier = threading.Thread(target=copy, args=(shift, result))
        copier.start()
        time.sleep(float(os.environ.get("GAP_S", "0.005")))
        if mode == "overlap":
            allocator.wake_up(["kv_cache"])
        kv_woken = time.monotonic()
        copier.join()
        end = time.monotonic()
        if "weights_load_s" not in result:
            print(f"{mode}: the copy failed (its thread's error is above)", flush=True)
            return 1
        print(f"KV_N={kv_n} HEAP={os.environ.get('HEAP', '0')} PIECE_MIB={piece >> 20} {mode:<7} gc={'on' if collect else 'off'} "
              f"shift={shift:>2}: wake weights {woke - start:.3f} s [{shown(waking_weights)}], "
              f"wake kv + gap {kv_woken - woke:.3f} s [{shown(spent)}], copy {result['weights_load_s']:.3f} s "
              f"({result['weights_gb_per_s']:.1f} GB/s), all {end - start:.3f} s", flush=True)
    del kv
    return 0


if __name__ == "__main__":
    sys.exit(main())
