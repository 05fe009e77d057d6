"""The one seam between the vLLM versions vsnap supports (0.26.0 on the GPU machine, 0.32.0 the
newest CPU build): where the few names that moved live in each.

vLLM 0.32 moved its OpenAI server into ``vllm.entrypoints.launchers`` (``openai.cli_args`` and
``entrypoints.launcher`` are gone; ``openai.api_server`` is a deprecated re-export). Each getter
tries the 0.32 home first and falls back to the 0.26 one, so the adapter and the rules use one
name whatever is installed. Everything else vsnap uses has the same name and signature in both
(the research behind this: docs/architecture.md, "vLLM versions").
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

# name -> (0.32 module, 0.26 module)
_HOMES = {
    "make_arg_parser": ("vllm.entrypoints.launchers.cli_args", "vllm.entrypoints.openai.cli_args"),
    "validate_parsed_serve_args": ("vllm.entrypoints.launchers.cli_args", "vllm.entrypoints.openai.cli_args"),
    "serve_http": ("vllm.entrypoints.launchers.launcher", "vllm.entrypoints.launcher"),
    "build_app": ("vllm.entrypoints.launchers.app", "vllm.entrypoints.openai.api_server"),
    "init_app_state": ("vllm.entrypoints.launchers.api_server.app_state", "vllm.entrypoints.openai.api_server"),
    "build_and_serve": ("vllm.entrypoints.launchers.api_server.entry", "vllm.entrypoints.openai.api_server"),
}


def _module(newer: str, older: str) -> ModuleType:
    try:
        return importlib.import_module(newer)
    except ModuleNotFoundError as exc:
        if exc.name is None or not newer.startswith(exc.name):
            raise  # the module exists but something it imports is missing: a real error
        return importlib.import_module(older)


def get(name: str) -> Any:
    """The vLLM object ``name`` (one of _HOMES), from wherever this vLLM keeps it."""
    newer, older = _HOMES[name]
    return getattr(_module(newer, older), name)


def server_module() -> ModuleType:
    """The module whose import pulls in vLLM's whole OpenAI server (imported before a capture so
    that a restore does not pay for it)."""
    return _module("vllm.entrypoints.launchers.api_server.entry", "vllm.entrypoints.openai.api_server")

