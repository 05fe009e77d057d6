"""The versions every side states: vsnap's own, and the control protocol's.

A leaf, so that the package face, the CLI, the manifest and the engine tree all read one number
without reaching back up to ``vsnap/__init__.py``.
"""

__version__ = "0.2.0"

# The engine contract: the CLI and the engine code frozen inside an image must speak the same
# version of the control messages. Raise it on any change of their meaning; the manifest records
# it, and a restore refuses an image of another version before CRIU runs.
PROTOCOL_VERSION = 3  # 3: standby.json (a standby waits for its activation without a timeout)
