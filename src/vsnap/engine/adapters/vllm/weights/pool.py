"""vLLM's sleep allocator and what lives in its pools: the weights pool's tensors (pool_tensors: what
the weights file holds), the CUDA graph pool routed into the allocator and tagged like the KV cache
(route_graph_pool_to_sleep_allocator, tag_graph_pool), and what holds the process's GPU memory
(device_memory_report)."""

from __future__ import annotations

import bisect
import warnings
from typing import Any, Callable

from .. import compat as vllm_compat
from .layout import storage_view

# The CUDA graph pool's allocations in vLLM's sleep-mode allocator carry the KV cache's tag: vLLM
# discards that memory at sleep and maps fresh memory at the same addresses at wake, which is what
# scratch memory needs (see route_graph_pool_to_sleep_allocator).
GRAPH_POOL_TAG = "kv_cache"


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
                vllm_compat.keep_pool(allocator, "vsnap_cudagraph_pool", pool, plug)  # kept alive with the others
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
