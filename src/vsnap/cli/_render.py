"""Everything the CLI draws: consoles, phase progress, the timing table, error lines, JSON.

Text that comes from outside (paths, spec keys, messages that quote them) is escaped before rich
sees it, and the consoles replace no :emoji: codes: a key named "[/]" in a model.yaml is printed,
not read as markup (it made rich raise MarkupError).
"""

from __future__ import annotations

import json
import sys
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ..protocol.errors import VsnapError
from .._events import PhaseEvent

JSON_FORMAT_VERSION = 1

stdout = Console(highlight=False, soft_wrap=True, emoji=False)
stderr = Console(stderr=True, highlight=False, soft_wrap=True, emoji=False)


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
    stderr.print(f"[bold red]error:[/] {escape(error.message)}")
    for issue in getattr(error, "issues", [])[1:]:  # a SpecError: every issue, each on its line
        stderr.print(f"       {issue}", markup=False)
    if error.hint:
        stderr.print(f"[yellow]hint:[/] {escape(error.hint)}")
    if error.log_path:
        stderr.print(f"log:  {error.log_path}", markup=False)
