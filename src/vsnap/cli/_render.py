"""Everything the CLI draws: consoles, phase progress, the timing table, error lines, JSON.

Text that comes from outside (paths, spec keys, messages that quote them) is escaped before rich
sees it, and the consoles replace no :emoji: codes: a key named "[/]" in a model.yaml is printed,
not read as markup (it made rich raise MarkupError). Control characters in text (an image's
manifest can hold ESC sequences that would drive root's terminal) are shown as ``\\xNN``: the
consoles clean every segment of text they render, whatever the caller forgot.

rich is imported when something is drawn with it, not at import (it was ~50 ms of every command's
start): ``stdout``, ``stderr`` and ``CleanConsole`` are made on first use (PEP 562), and the phase
progress of a command whose stderr is no terminal (`vsnap restore --json` under the bench or a
script) is written as the plain lines rich would have written there.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import TYPE_CHECKING, Any, Iterable

from vsnap.host.events import PhaseEvent
from vsnap.protocol.errors import VsnapError

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

JSON_FORMAT_VERSION = 1

# What clean() escapes: every character str.isprintable() refuses (C0 and C1 controls, ESC and
# 0x9b (CSI) among them, DEL, lone surrogates, which no terminal encoding can write, and Unicode's
# invisible format characters and separators: bidi overrides that show a name reversed, zero-width
# characters that make two names look alike), but tab and newline.


def _unprintable(text: str) -> bool:
    return not text.isprintable() and not text.replace("\n", "").replace("\t", "").isprintable()


def clean(text: str) -> str:
    """``text`` with every character it must not show as it is (see above) written as ``\\xNN``
    or ``\\uNNNN``; tabs and newlines stay (one_line escapes them too)."""
    if not _unprintable(text):
        return text
    return "".join(c if c.isprintable() or c in "\n\t" else f"\\x{ord(c):02x}" if ord(c) < 0x100
                   else f"\\u{ord(c):04x}" if ord(c) < 0x10000 else f"\\U{ord(c):08x}" for c in text)


def one_line(text: str) -> str:
    """``text`` cleaned (clean), newlines and tabs escaped too: for a table's cell or a message's
    line, where a name someone else chose must not forge a line."""
    return clean(text).replace("\n", "\\n").replace("\t", "\\t")


def escape(text: str) -> str:
    """rich.markup.escape, imported when first needed."""
    from rich.markup import escape as rich_escape

    return rich_escape(text)


def _clean_console_class() -> type:
    from rich.console import Console
    from rich.segment import Segment

    class CleanConsole(Console):
        """A rich Console whose rendered text never carries control characters (its own styling and
        cursor controls, which are not text, pass)."""

        def render(self, renderable: Any, options: Any = None) -> Iterable[Segment]:
            for segment in super().render(renderable, options):
                if segment.control or not _unprintable(segment.text):
                    yield segment
                else:
                    yield Segment(clean(segment.text), segment.style, segment.control)

    CleanConsole.__module__ = __name__
    return CleanConsole


def __getattr__(name: str) -> Any:
    """``CleanConsole``, ``stdout`` and ``stderr``, made (and rich imported) on first use."""
    if name == "CleanConsole":
        value: Any = _clean_console_class()
    elif name == "stdout":
        value = _get("CleanConsole")(highlight=False, soft_wrap=True, emoji=False)
    elif name == "stderr":
        value = _get("CleanConsole")(stderr=True, highlight=False, soft_wrap=True, emoji=False)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def _get(name: str) -> Any:
    """This module's ``name`` as other modules see it (made on first use)."""
    return globals()[name] if name in globals() else __getattr__(name)


def _stderr_is_plain() -> bool:
    """Whether rich would draw on stderr as on a file: no terminal, and none of the environment
    variables that make rich treat a file as one (rich.console.Console.is_terminal)."""
    if any(name in os.environ for name in ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE")):
        return False
    if "IPython" in sys.modules or "stderr" in globals() or sys.stderr is None:
        return False  # Jupyter, a console someone made or put in place (tests do), or no stderr at all
    try:
        return not sys.stderr.isatty()
    except (AttributeError, ValueError):  # no stderr, or a closed one: rich says "no terminal" too
        return True


class PhaseProgress:
    """Shows the running phase with a spinner and a line per finished phase, on stderr."""

    def __init__(self, console: Console | None = None) -> None:
        self._console = console
        self._plain = console is None and _stderr_is_plain()  # then rich is never imported for it
        self._status: Any = None
        self._started: dict[str, tuple[float, int]] = {}  # phase -> when its first progress came, and its bytes
        self._printed_at = time.monotonic()

    @property
    def console(self) -> Console:
        if self._console is None:
            self._console = _get("stderr")
        return self._console

    def __call__(self, event: PhaseEvent) -> None:
        if event.state == "progress":
            self._progress(event)
            return
        if self._plain:
            if event.state != "start":  # what rich writes to a file: the mark and the text, no styles
                mark = "✓" if event.state == "done" else "✗"
                sys.stderr.write(clean(f"{mark} {event.phase:<16} {event.seconds or 0:7.2f} s") + "\n")
                sys.stderr.flush()
            return
        if event.state == "start":
            if self.console.is_terminal:
                self._status = self.console.status(f"{event.phase}…")
                self._status.start()
            return
        if self._status is not None:
            self._status.stop()
            self._status = None
        mark = "[green]✓[/]" if event.state == "done" else "[red]✗[/]"
        self.console.print(f"{mark} {escape(f'{event.phase:<16}')} {event.seconds or 0:7.2f} s")

    PLAIN_EVERY_S = 10.0  # a log (not a terminal) gets a progress line at most this often

    def _progress(self, event: PhaseEvent) -> None:
        """A long transfer's bytes: the spinner's text on a terminal, a line every PLAIN_EVERY_S
        in a log."""
        now = time.monotonic()
        started = self._started.setdefault(event.phase, (now, event.done_bytes or 0))
        done, total = event.done_bytes or 0, event.total_bytes or 0
        rate = (done - started[1]) / max(now - started[0], 1e-6)
        of = f" of {total / 1e9:.2f}" if total else ""
        text = f"{event.phase} {done / 1e9:.2f}{of} GB, {rate / 1e9:.2f} GB/s"
        if self._plain:
            if now - self._printed_at >= self.PLAIN_EVERY_S:
                self._printed_at = now
                sys.stderr.write(clean(f"  {text}") + "\n")
                sys.stderr.flush()
        elif self._status is not None:
            self._status.update(escape(f"{text}…"))

    def close(self) -> None:
        if self._status is not None:
            self._status.stop()
            self._status = None


def timing_table(title: str, seconds: dict[str, float], extra: dict[str, float] | None = None) -> Table:
    from rich.table import Table

    table = Table(title=escape(one_line(title)), title_justify="left")
    table.add_column("phase")
    table.add_column("seconds", justify="right")
    for phase, value in seconds.items():
        table.add_row(escape(one_line(phase)), f"{value:.3f}")
    table.add_row("[bold]total[/]", f"[bold]{sum(seconds.values()):.3f}[/]")
    for name, value in (extra or {}).items():  # names the restored tree's report chose: one line each
        if name.endswith("_s"):  # the breakdown inside the phases above (engine and handoff)
            table.add_row(escape(one_line(f"  · {name.removesuffix('_s').replace('_', ' ')}")), f"{value:.3f}")
    return table


def print_json(kind: str, data: dict[str, Any]) -> None:
    """One versioned JSON document on stdout."""
    sys.stdout.write(json.dumps({"format_version": JSON_FORMAT_VERSION, "kind": kind, **data}, indent=2,
                                default=str) + "\n")
    sys.stdout.flush()


def print_error(error: VsnapError, as_json: bool) -> None:
    if as_json:
        print_json("error", error.to_dict())
        return
    console = _get("stderr")
    # a message's own lines (a host mismatch's facts, an engine's multi-line error) each one_line
    # and indented: a newline in a name the message quotes cannot forge an `error:` or `hint:` line
    # (those start at the margin)
    first, *more = error.message.split("\n")
    console.print(f"[bold red]error:[/] {escape(one_line(first))}")
    for line in more:
        console.print(f"  {one_line(line.lstrip())}", markup=False)
    for issue in getattr(error, "issues", [])[1:]:  # a SpecError: every issue, each on its line
        console.print(f"       {one_line(str(issue))}", markup=False)
    if error.hint:
        console.print(f"[yellow]hint:[/] {escape(one_line(error.hint))}")
    if error.log_path:
        console.print(f"log:  {one_line(error.log_path)}", markup=False)
