"""The built-in CPU engine (placeholder docstring, rewritten below)."""

from __future__ import annotations

from typing import Any

__all__ = ["CpuAdapter"]


def __getattr__(name: str) -> Any:
    if name == "CpuAdapter":
        from .adapter import CpuAdapter

        return CpuAdapter
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
