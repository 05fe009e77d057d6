"""The vsnap command line: thin commands over the library, one error boundary, named exit codes.

Each command lives in its module, which registers it on ``_app`` when imported. ``app`` (this
module's attribute, PEP 562) is that Typer with every command loaded; ``main()``, the entry point,
loads only the command its first argument names (all of them for anything else: ``vsnap --help``,
``vsnap --json CMD``): the other eleven modules were ~20 ms of every command's start.
"""

from __future__ import annotations

import errno
import functools
import gc
import importlib
import signal
import sys
from typing import Any, Callable, Sequence, TypeVar

import typer
from typer.core import TyperGroup

from vsnap.host.paths import require_runtime_dir
from vsnap.protocol.errors import UsageError, VsnapError
from vsnap.protocol.version import PROTOCOL_VERSION, __version__

from . import _render

EXIT_CODES_HELP = """
Exit codes: 0 ok · 1 error · 2 bad model.yaml or usage · 3 host not ready
(CRIU, root, port, registry) · 4 image missing, altered, untrusted or from another
host · 5 checkpoint/restore failed · 6 engine failed · 7 oracle mismatch
after restore · 8 unsafe control file · 9 nothing running · 10 no such
instance · 11 option not supported here · 130 interrupted.
"""


# Click's usage-error class, found through typer (which may carry its own copy of Click)
ClickUsageError: type[Exception] = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "UsageError")
_NO_ARGS_IS_HELP = getattr(sys.modules[ClickUsageError.__module__], "NoArgsIsHelpError", ())


def wants_json(args: Sequence[str]) -> bool:
    """Whether a command line asks for JSON (``--json`` anywhere before a ``--``)."""
    for arg in args:
        if arg == "--":
            return False
        if arg == "--json":
            return True
    return False


def _json_usage_error(error: Any) -> typer.Exit:
    """Print a Click usage error as vsnap's JSON error document; the Exit to raise (code 2)."""
    command = error.ctx.command_path if getattr(error, "ctx", None) is not None else "vsnap"
    usage = UsageError(error.format_message(), hint=f"{command} --help shows the usage")
    _render.print_json("error", usage.to_dict())
    return typer.Exit(usage.exit_code)


class VsnapGroup(TyperGroup):
    """Click's usage errors (unknown option, bad value, missing argument) on a command line with
    --json become one JSON error document on stdout (exit 2); without --json Click prints them."""

    def make_context(self, info_name: str | None, args: list[str], parent: Any = None, **extra: Any) -> Any:
        as_json = wants_json(args)
        try:
            ctx = super().make_context(info_name, args, parent=parent, **extra)
        except ClickUsageError as error:
            if as_json and not isinstance(error, _NO_ARGS_IS_HELP):
                raise _json_usage_error(error) from None
            raise
        ctx.meta["vsnap.json"] = as_json
        return ctx

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except ClickUsageError as error:  # the subcommand's own arguments
            if ctx.meta.get("vsnap.json"):
                raise _json_usage_error(error) from None
            raise

    def list_commands(self, ctx: Any) -> list[str]:
        """In COMMANDS' order, whichever module was imported first."""
        order = {name: i for i, name in enumerate(COMMANDS)}
        return sorted(super().list_commands(ctx), key=lambda name: order.get(name, len(order)))


# Every command's module, in the order `vsnap --help` lists them
COMMANDS = ("restore", "activate", "serve", "bench", "capture", "images", "inspect", "ps", "pull", "push", "rm",
            "stop", "validate")

_app = typer.Typer(
    name="vsnap",
    cls=VsnapGroup,
    help="Capture a booted LLM server once; restore it in about a second.\n\n" + EXIT_CODES_HELP,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
)


def versions() -> dict[str, Any]:
    """vsnap's version, and the versions of the engine contract and the image format it speaks."""
    from vsnap.image.manifest import FORMAT_VERSION  # only for --version: a command's start loads no image module


    return {"vsnap": __version__, "control_protocol": PROTOCOL_VERSION, "image_format": FORMAT_VERSION}


@_app.callback(invoke_without_command=True)
def _main(
    ctx: typer.Context,
    version: bool = typer.Option(False, "--version", help="print vsnap's version (and its protocol and image "
                                                          "format versions) and exit"),
    as_json: bool = typer.Option(False, "--json", help="JSON output: with --version, or for the command that "
                                                       "follows (same as its own --json)"),
) -> None:
    if version:
        found = versions()
        if as_json:
            _render.print_json("version", found)
        else:
            extra = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in found.items() if k != "vsnap")
            _render.stdout.print(f"vsnap {found['vsnap']}" + (f" ({extra})" if extra else ""))
        raise typer.Exit(0)
    if ctx.invoked_subcommand is None:
        raise ClickUsageError("missing command (vsnap --help lists them)", ctx=ctx)
    if as_json:  # `vsnap --json CMD ...` is `vsnap CMD --json ...`: every command has --json
        ctx.default_map = {**(ctx.default_map or {}), ctx.invoked_subcommand: {"as_json": True}}


F = TypeVar("F", bound=Callable[..., Any])


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


# A full or read-only disk is the host's condition, not a bug: one line, not a traceback
DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)


def error_boundary(fn: F) -> F:
    """Expected errors -> one line, hint, log path and the error's exit code. Bugs keep their traceback."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        # SIGTERM and SIGHUP (a closed terminal) tear down like Ctrl-C: the default action would end
        # vsnap at once and leave its tree, staging directory and records to the next run's pruning
        for signum in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, _raise_interrupt)
        # Ctrl-C tears down too, even when vsnap was started with SIGINT ignored (a background job
        # of a non-interactive shell inherits SIG_IGN, and Python then installs no handler)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            require_runtime_dir()
            return fn(*args, **kwargs)
        except VsnapError as error:
            _render.print_error(error, bool(kwargs.get("as_json")))
            raise typer.Exit(code=error.exit_code) from None
        except OSError as exc:
            if exc.errno not in DISK_ERRNOS:
                raise  # anything else is a bug: keep its traceback
            where = f" writing {exc.filename}" if exc.filename else ""
            error = VsnapError(f"{exc.strerror}{where}", hint="free space on that filesystem (or make it writable), "
                                                              "then run the command again; nothing was left half done")
            _render.print_error(error, bool(kwargs.get("as_json")))
            raise typer.Exit(code=error.exit_code) from None
        except KeyboardInterrupt:
            _render.stderr.print("interrupted")
            raise typer.Exit(code=130) from None

    return wrapper  # type: ignore[return-value]


def load_commands(only: str | None = None) -> None:
    """Import (and so register) the module of command ``only``, or of every command."""
    for name in (only,) if only in COMMANDS else COMMANDS:
        importlib.import_module(f"{__name__}.{name}")


def __getattr__(name: str) -> Any:
    if name == "app":  # the CLI as tests and library users see it: every command
        load_commands()
        globals()["app"] = _app
        return _app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def main() -> None:
    load_commands(sys.argv[1] if len(sys.argv) > 1 else None)
    try:
        _app()
    finally:
        # The interpreter's exit runs several full garbage collections over every object the
        # imports made (pydantic's schemas, typer, rich: ~40k): 60 to 90 ms of a command's wall time
        # on a loaded 2-core VM. Frozen objects are not traversed again; what the exit does
        # otherwise (atexit, thread joins, flushing) is unchanged.
        gc.freeze()


if __name__ == "__main__":
    sys.exit(main())
