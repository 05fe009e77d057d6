"""What the vsnap CLI and the engine tree share, and all that the engine side may import.

    errors.py    the error tree (exit codes, hints)
    control.py   control messages, the protocol version, no-follow atomic file I/O, deadline waits
    oracle.py    the oracle model and its comparison
    loopback.py  bring up `lo` in a fresh network namespace

Nothing here imports the orchestrator (capture, restore, CRIU, psutil, yaml); a test in a fresh
interpreter keeps it so (tests/unit/test_engine_boundary.py).
"""
