"""The physical floor of a restore: the bytes it moves over this host's measured bandwidths.

The image's CRIU bytes over this disk's measured read bandwidth (8 threads, page cache as it is),
plus the weight bytes a restore reads besides CRIU's pages over the slower of that bandwidth and
the measured host-to-device bandwidth (vLLM on CUDA: pinned copies in a CUDA subprocess; the cpu
engine: the read bandwidth). On vLLM's CPU backend the weights come back inside CRIU's pages: no
separate weight bytes, no host-to-device copy.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from vsnap.image.manifest import WEIGHTS_DIR


def read_bandwidth(paths: list[Path], threads: int = 8, piece: int = 32 << 20) -> float:
    """Bytes per second reading these files in 32 MiB pieces on 8 threads, each into its own
    reused buffer (as a restore streams the weights file), from whatever the page cache holds."""
    jobs = [(path, offset) for path in paths for offset in range(0, path.stat().st_size, piece)]
    counter = itertools.count()
    buffers = [bytearray(piece) for _ in range(threads)]  # allocated (and zeroed) before the clock starts

    def reader(buffer: bytearray) -> int:
        total = 0
        while (index := next(counter)) < len(jobs):
            path, offset = jobs[index]
            fd = os.open(path, os.O_RDONLY)
            try:
                total += os.preadv(fd, [buffer], offset)
            finally:
                os.close(fd)
        return total

    start = time.monotonic()
    with ThreadPoolExecutor(max_workers=threads) as pool:
        total = sum(pool.map(reader, buffers))
    return total / max(time.monotonic() - start, 1e-9)


H2D_PROBE = """
import torch, time
n = 1 << 30
host = torch.empty(n, dtype=torch.uint8).pin_memory()
dev = torch.empty(n, dtype=torch.uint8, device="cuda")
dev.copy_(host, non_blocking=True); torch.cuda.synchronize()
t = time.perf_counter()
for _ in range(5):
    dev.copy_(host, non_blocking=True)
torch.cuda.synchronize()
print(5 * n / (time.perf_counter() - t))
"""


def h2d_bandwidth() -> float | None:
    """Host-to-device bytes per second of pinned 1 GiB copies (H2D_PROBE) in a new interpreter;
    None when it reports none (no torch, no GPU)."""
    # from / : `python -c` puts its working directory first on sys.path
    out = subprocess.run([sys.executable, "-c", H2D_PROBE], capture_output=True, text=True, timeout=300, cwd="/")
    try:
        return float(out.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return None


@dataclass(frozen=True)
class Floor:
    seconds: float
    weight_bytes: int  # what a restore reads besides CRIU's pages
    read_bytes_per_s: float
    h2d_bytes_per_s: float | None  # measured only where the weights go to a GPU


def restore_floor(image_files: list[Path], image_bytes: int, model_dir: Path, vllm_on: str | None, *,
                  read: Callable[[list[Path]], float] = read_bandwidth,
                  h2d: Callable[[], float | None] = h2d_bandwidth) -> Floor:
    """The least a restore can take: bytes moved over measured bandwidths. ``vllm_on`` is
    ``vllm_device()`` for the vllm engine ("cuda" or "cpu"), None for the cpu engine.

    The weights a restore reads besides CRIU's pages: the image's weights file, else the model's
    safetensors (vLLM's loader on CUDA, the cpu engine's reload); none on vLLM's CPU backend,
    where they come back as the tree's own memory. They move at the slower of the read and the
    host-to-device bandwidth (measured only on CUDA)."""
    weights_file = [p for p in image_files if p.parent.name == WEIGHTS_DIR]
    if weights_file:
        weights = weights_file
    elif vllm_on == "cpu":
        weights = []
    else:
        weights = sorted(model_dir.rglob("*.safetensors"))
    weight_bytes = sum(p.stat().st_size for p in weights)
    disk_bw = read(image_files)
    h2d_bw = h2d() if vllm_on == "cuda" else None
    rest_bytes = image_bytes - (weight_bytes if weights_file else 0)  # what CRIU reads
    seconds = rest_bytes / disk_bw + weight_bytes / min(disk_bw, h2d_bw or disk_bw)
    return Floor(seconds, weight_bytes, disk_bw, h2d_bw)

