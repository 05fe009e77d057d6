"""The CUDA graph pool in vLLM's sleep allocator: its allocations get the KV cache's tag.

No GPU here, and vllm.device_allocator.cumem needs libcuda to import: the allocator is a stand-in
with CuMemAllocator's bookkeeping (``instance``, ``default_tag``, ``pointer_to_data`` of vLLM's
own AllocationData); the GPU runs (scripts/gpu-probe-sleep.sh, the capture's rehearsal) cover
the real one.
"""

from __future__ import annotations

import sys
import types

import pytest

from vsnap.engine.adapters.vllm.weights import pool as weights_pool


class CuMemAllocator:
    instance: "CuMemAllocator | None" = None
    default_tag = "default"


@pytest.fixture(autouse=True)
def cumem(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    module = types.ModuleType("vllm.device_allocator.cumem")
    module.CuMemAllocator = CuMemAllocator  # type: ignore[attr-defined]
    module.cumem_available = False  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm.device_allocator.cumem", module)
    import vllm.device_allocator

    monkeypatch.setattr(vllm.device_allocator, "cumem", module, raising=False)
    monkeypatch.setattr(CuMemAllocator, "instance", None)
    return module


@pytest.fixture
def allocator(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    from vllm.device_allocator import AllocationData

    fake = CuMemAllocator()
    fake.pointer_to_data = {
        0x1000: AllocationData((0, 1 << 30, 0x1000, None), "weights"),
        0x2000: AllocationData((0, 2 << 30, 0x2000, None), "kv_cache"),
        0x3000: AllocationData((0, 32 << 20, 0x3000, None), CuMemAllocator.default_tag),  # captured graphs
        0x4000: AllocationData((0, 2 << 20, 0x4000, None), CuMemAllocator.default_tag),
    }
    fake.current_tag = CuMemAllocator.default_tag
    fake.allocator_and_pools = {}
    monkeypatch.setattr(CuMemAllocator, "instance", fake)
    monkeypatch.setattr(weights_pool, "_graph_pool_pointers", set())
    return fake


def test_graph_pool_allocations_take_the_kv_cache_tag(allocator) -> None:  # type: ignore[no-untyped-def]
    assert weights_pool.tag_graph_pool() == (32 << 20) + (2 << 20)
    tags = {ptr: data.tag for ptr, data in allocator.pointer_to_data.items()}
    assert tags == {0x1000: "weights", 0x2000: "kv_cache", 0x3000: "kv_cache", 0x4000: "kv_cache"}
    assert weights_pool.GRAPH_POOL_TAG == "kv_cache"  # what vLLM's own wake_up(tags=["kv_cache"]) maps again


def test_tagging_again_counts_the_same_bytes(allocator) -> None:  # type: ignore[no-untyped-def]
    first = weights_pool.tag_graph_pool()
    assert weights_pool.tag_graph_pool() == first  # a rehearsal's sleep, then the capture's


def test_no_allocator_no_tagging() -> None:
    assert weights_pool.tag_graph_pool() == 0


def test_routing_needs_the_cumem_allocator() -> None:
    from vllm.platforms import current_platform

    assert weights_pool.route_graph_pool_to_sleep_allocator() is False  # cumem_available is False
    assert not getattr(type(current_platform), "_vsnap_graph_pool_routed", False)
