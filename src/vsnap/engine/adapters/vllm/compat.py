"""The one seam between the vLLM versions vsnap supports (0.26.0 on the GPU machine, 0.32.0 the
newest CPU build, 0.33.0 the newest release): where the few names that moved live in each, and
which versions vsnap was tested with.

vLLM 0.32 moved its OpenAI server into ``vllm.entrypoints.launchers`` (``openai.cli_args`` and
``entrypoints.launcher`` are gone; ``openai.api_server`` is a deprecated re-export); 0.33 moved the
argument parser once more, into ``vllm.entrypoints.common.cli_args`` (``launchers.cli_args`` is
gone). Each getter tries the homes newest first, so the adapter and the rules use one name
whatever is installed. Since 0.32 the cumem allocator keeps a list of pools per tag (0.26: one
pool): keep_pool writes either shape. Everything else vsnap uses has the same name and signature
in all three (the research behind this: docs/architecture.md, "vLLM versions and the CPU backend").
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

# The vLLM releases vsnap's rules and adapter were checked against (CI: make test-vllm,
# test-vllm-cpu, test-vllm033); `vsnap validate` and a capture's preflight warn on any other.
TESTED_VLLM = ("0.26.0", "0.32.0", "0.33.0")

_PARSER_HOMES = ("vllm.entrypoints.common.cli_args",  # 0.33
                 "vllm.entrypoints.launchers.cli_args",  # 0.32
                 "vllm.entrypoints.openai.cli_args")  # 0.26
_SERVER_HOMES = ("vllm.entrypoints.launchers.api_server.entry", "vllm.entrypoints.openai.api_server")

# name -> its modules, newest vLLM first
_HOMES: dict[str, tuple[str, ...]] = {
    "make_arg_parser": _PARSER_HOMES,
    "validate_parsed_serve_args": _PARSER_HOMES,
    "serve_http": ("vllm.entrypoints.launchers.launcher", "vllm.entrypoints.launcher"),
    "build_app": ("vllm.entrypoints.launchers.app", "vllm.entrypoints.openai.api_server"),
    "init_app_state": ("vllm.entrypoints.launchers.api_server.app_state", "vllm.entrypoints.openai.api_server"),
    "build_and_serve": _SERVER_HOMES,
}


def _module(homes: tuple[str, ...]) -> ModuleType:
    """The first of ``homes`` this vLLM has. Only a missing home itself moves on to the next: a
    home that exists but fails to import (something it imports is missing) is a real error."""
    for home in homes[:-1]:
        try:
            return importlib.import_module(home)
        except ModuleNotFoundError as exc:
            if exc.name is None or not home.startswith(exc.name):
                raise
    return importlib.import_module(homes[-1])


def get(name: str) -> Any:
    """The vLLM object ``name`` (one of _HOMES), from wherever this vLLM keeps it."""
    return getattr(_module(_HOMES[name]), name)


def server_module() -> ModuleType:
    """The module whose import pulls in vLLM's whole OpenAI server (imported before a capture so
    that a restore does not pay for it)."""
    return _module(_SERVER_HOMES)


def keep_pool(allocator: Any, name: str, pool: Any, plug: Any) -> None:
    """Keep a memory pool of vLLM's cumem allocator alive among the allocator's own pools, which
    vLLM releases together at shutdown. 0.32 and 0.33 keep a list of (pool, allocator) pairs per
    tag and iterate each value (a bare pair there would break the release); 0.26 keeps one pair.
    The shape is read from the pools already there (the weights' are, whenever this is called)."""
    pools = allocator.allocator_and_pools
    listed = any(isinstance(entry, list) for entry in pools.values())
    pools[name] = [(pool, plug)] if listed else (pool, plug)
