"""The vsnap command line: thin commands over the library, one error boundary, named exit codes."""

from __future__ import annotations

import functools
import signal
import sys
from typing import Any, Callable, TypeVar

import typer

from ..protocol.errors import VsnapError
from . import _render

EXIT_CODES_HELP = """
Exit codes: 0 ok · 1 error · 2 bad model.yaml or usage · 3 host not ready (CRIU, root, port) ·
4 image missing, altered or from another host · 5 checkpoint/restore failed ·
6 engine failed · 7 oracle mismatch after restore · 8 unsafe control file · 130 interrupted.
"""

app = typer.Typer(
    name="vsnap",
    help="Capture a booted LLM server once; restore it in about a second.\n\n" + EXIT_CODES_HELP,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
)

F = TypeVar("F", bound=Callable[..., Any])


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def error_boundary(fn: F) -> F:
    """Expected errors -> one line, hint, log path and the error's exit code. Bugs keep their traceback."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        signal.signal(signal.SIGTERM, _raise_interrupt)
        try:
            return fn(*args, **kwargs)
        except VsnapError as error:
            _render.print_error(error, bool(kwargs.get("as_json")))
            raise typer.Exit(code=error.exit_code) from None
        except KeyboardInterrupt:
            _render.stderr.print("interrupted")
            raise typer.Exit(code=130) from None

    return wrapper  # type: ignore[return-value]


from . import bench, capture, inspect, ps, restore, stop, validate  # noqa: E402,F401  (registers the commands)


def main() -> None:
    app()


if __name__ == "__main__":
    sys.exit(main())
