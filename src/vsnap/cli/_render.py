"""Everything the CLI draws: consoles, phase progress, the timing table, error lines, JSON.

Text that comes from outside (paths, spec keys, messages that quote them) is escaped before rich
sees it, and the consoles replace no :emoji: codes: a key named "[/]" in a model.yaml is printed,
not read as markup (it made rich raise MarkupError). Control characters in text (an image's
manifest can hold ESC sequences that would drive root's terminal) are shown as ``\\xNN``: the
consoles clean every segment of text they render, whatever the caller forgot.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import re
from typing import Iterable

from rich.console import Console
from rich.markup import escape
from rich.segment import Segment
from rich.table import Table

from ..protocol.errors import VsnapError
from .._events import PhaseEvent

JSON_FORMAT_VERSION = 1

# C0 controls but tab and newline, DEL, C1 controls (0x9b is CSI on many terminals)
CONTROL_CHARACTERS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def clean(text: str) -> str:
    """``text`` with every control character (ESC included) written as ``\\xNN``."""
    return CONTROL_CHARACTERS.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


class CleanConsole(Console):
    """A rich Console whose rendered text never carries control characters (its own styling and
    cursor controls, which are not text, pass)."""

    def render(self, renderable: Any, options: Any = None) -> Iterable[Segment]:
        for segment in super().render(renderable, options):
            if segment.control or not CONTROL_CHARACTERS.search(segment.text):
                yield segment
            else:
                yield Segment(clean(segment.text), segment.style, segment.control)


stdout = CleanConsole(highlight=False, soft_wrap=True, emoji=False)
stderr = CleanConsole(stderr=True, highlight=False, soft_wrap=True, emoji=False)


class PhaseProgress:
    """Shows the running phase with a spinner and a line per finished phase, on stderr."""

    def __init__(self, console: Console | None = None) -> None:
        self.console = console or stderr
        self._status: Any = None

    def __call__(self, event: PhaseEvent) -> None:
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

    def close(self) -> None:
        if self._status is not None:
            self._status.stop()
            self._status = None


def timing_table(title: str, seconds: dict[str, float], extra: dict[str, float] | None = None) -> Table:
    table = Table(title=escape(title), title_justify="left")
    table.add_column("phase")
    table.add_column("seconds", justify="right")
    for phase, value in seconds.items():
        table.add_row(escape(phase), f"{value:.3f}")
    table.add_row("[bold]total[/]", f"[bold]{sum(seconds.values()):.3f}[/]")
    for name, value in (extra or {}).items():
        if name.endswith("_s"):  # the breakdown inside the phases above (engine and handoff)
            table.add_row(escape(f"  · {name.removesuffix('_s').replace('_', ' ')}"), f"{value:.3f}")
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
    stderr.print(f"[bold red]error:[/] {escape(clean(error.message))}")
    for issue in getattr(error, "issues", [])[1:]:  # a SpecError: every issue, each on its line
        stderr.print(f"       {clean(str(issue))}", markup=False)
    if error.hint:
        stderr.print(f"[yellow]hint:[/] {escape(clean(error.hint))}")
    if error.log_path:
        stderr.print(f"log:  {clean(error.log_path)}", markup=False)
