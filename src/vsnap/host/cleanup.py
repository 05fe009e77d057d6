"""Cleanup that cannot be skipped: each resource registered as it is made, all released on exit.

A use case (capture, restore, bench) registers a release callback right after it makes each
resource (a process tree, a directory, a namespace fd, a record). On failure every callback
runs, newest first, each one even if an earlier one raised; the error that caused the failure
is the one that propagates, and cleanup errors are attached to it as notes, never hiding it.
On success the use case keeps what it returns (``keep``) and releases only the rest.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any, Callable


class Cleanup:
    def __init__(self) -> None:
        # (callback, args, when): True always, False on failure only, None on success only
        self._callbacks: list[tuple[Callable[..., Any], tuple[Any, ...], bool | None]] = []

    def on_exit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Release this on every exit, success included."""
        self._callbacks.append((fn, args, True))

    def on_failure(self, fn: Callable[..., Any], *args: Any) -> None:
        """Release this only if the use case fails (on success the caller keeps it)."""
        self._callbacks.append((fn, args, False))

    def on_success(self, fn: Callable[..., Any], *args: Any) -> None:
        """Release this only if the use case succeeds (a failure keeps it, e.g. the logs it names)."""
        self._callbacks.append((fn, args, None))

    def release(self, failed: bool) -> list[BaseException]:
        """Run the callbacks, newest first; return the errors they raised (all of them ran)."""
        errors: list[BaseException] = []
        callbacks, self._callbacks = self._callbacks, []
        for fn, args, when in reversed(callbacks):
            if when is False and not failed or when is None and failed:
                continue
            try:
                fn(*args)
            except BaseException as exc:  # noqa: BLE001 (every callback must run)
                errors.append(exc)
        return errors

    def __enter__(self) -> "Cleanup":
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> bool:
        errors = self.release(failed=exc is not None)
        if exc is not None:
            for error in errors:
                note = f"during cleanup: {type(error).__name__}: {error}"
                if hasattr(exc, "add_note"):
                    exc.add_note(note)
            return False  # the original error propagates
        if errors:
            raise errors[0]
        return False
