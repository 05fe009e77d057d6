"""Engine adapters, found by name: cpu (built in, PyTorch on CPU) and vllm (real vLLM on a GPU).

``base`` holds only the verbs (EngineAdapter); each engine is a subpackage that subclasses it,
imported on first use from the mapping below, so no adapter's dependencies load for another's
tree and base imports none of its subclasses (no cycle).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vsnap.protocol.control import LaunchConfig

    from .base import EngineAdapter

# LaunchConfig.engine -> "module:class"
ADAPTERS = {
    "cpu": "vsnap.engine.adapters.cpu.adapter:CpuAdapter",
    "vllm": "vsnap.engine.adapters.vllm.adapter:VllmAdapter",
}


def make_adapter(launch: LaunchConfig) -> EngineAdapter:
    """The adapter for the launch's engine, its module imported now."""
    module, _, name = ADAPTERS[launch.engine].partition(":")
    adapter_class: type[EngineAdapter] = getattr(importlib.import_module(module), name)
    return adapter_class(launch)
