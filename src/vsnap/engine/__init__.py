"""The engine tree: runs inside its own PID and mount namespace (see __main__)."""
