"""vsnap: capture a booted LLM server once, restore it in about a second.

The public API is what this module re-exports. It imports no torch, CUDA or rich: the engine
tree imports vsnap too.
"""

from ._capture import CaptureResult, capture_image
from ._errors import (
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
from ._manifest import Manifest, read_manifest
from ._restore import RestoredServer, restore_image, stop_server, verify_image
from ._spec import ModelSpec, load_spec

__all__ = [
    "CaptureResult", "capture_image", "RestoredServer", "restore_image", "stop_server", "verify_image",
    "ModelSpec", "load_spec", "Manifest", "read_manifest",
    "VsnapError", "SpecError", "HostNotReady", "ImageError", "ImageTampered", "ImageHostMismatch",
    "CheckpointError", "CriuError", "EngineError", "OracleMismatch", "ControlProtocolError",
]
