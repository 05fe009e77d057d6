"""vsnap: capture a booted LLM server once, restore it in about a second.

The public API is what this module re-exports, loaded lazily (PEP 562): ``import vsnap`` or
``import vsnap.protocol`` costs nothing else, so the engine tree, which imports only
``vsnap.protocol`` and ``vsnap.engine``, never loads the orchestrator (capture, restore, CRIU,
psutil, yaml) into its processes and so into every image.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .protocol.version import __version__

# public name -> the module that defines it
_EXPORTS = {
    "CaptureResult": ".ops.capture", "capture_image": ".ops.capture",
    "RestoredServer": ".ops.bringup", "restore_image": ".ops.restore", "verify_image": ".ops.restore",
    "activate_instance": ".ops.standby", "stop_server": ".ops.stop", "Image": ".image.handle",
    "open_image": ".image.handle",
    "ModelSpec": ".spec.schema", "load_spec": ".spec.schema",
    "Manifest": ".image.manifest", "read_manifest": ".image.manifest",
    **{name: ".protocol.errors" for name in (
        "VsnapError", "SpecError", "HostNotReady", "ImageError", "ImageTampered", "ImageHostMismatch",
        "CheckpointError", "CriuError", "EngineError", "OracleMismatch", "ControlProtocolError")},
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'vsnap' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)


if TYPE_CHECKING:
    from vsnap.image.handle import Image, open_image
    from vsnap.image.manifest import Manifest, read_manifest
    from vsnap.ops.bringup import RestoredServer
    from vsnap.ops.capture import CaptureResult, capture_image
    from vsnap.ops.restore import restore_image, verify_image
    from vsnap.ops.standby import activate_instance
    from vsnap.ops.stop import stop_server
    from vsnap.protocol.errors import (
        CheckpointError,
        ControlProtocolError,
        CriuError,
        EngineError,
        HostNotReady,
        ImageError,
        ImageHostMismatch,
        ImageTampered,
        OracleMismatch,
        SpecError,
        VsnapError,
    )
    from vsnap.spec.schema import ModelSpec, load_spec
