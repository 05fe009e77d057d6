"""vsnap validate [SPEC|IMAGE]"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer
from rich.markup import escape
from rich.table import Table
from rich.text import Text

if TYPE_CHECKING:
    from vsnap.host.facts import Check

from . import _app as app
from . import _render, error_boundary


def detail(check: Check) -> str:
    """A check's detail for the table; a spec error of several issues says so (they follow the table)."""
    issues = getattr(check.error, "issues", None) or getattr(check.error, "mismatches", [])
    if len(issues) > 1:
        return f"{len(issues)} problems, each listed below"
    return check.detail


@app.command(help="Check, before anything expensive runs, whether this host can capture SPEC or restore IMAGE "
                  "(no argument: check the host). Exits with the code of the first failed check.")
@error_boundary
def validate(
    target: Optional[Path] = typer.Argument(None, help="a model.yaml or an image directory"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON document on stdout"),
) -> None:
    from vsnap.ops.validate import (
        validate_target,  # here, not at import: every vsnap command loads every command module
    )

    report = validate_target(target)
    if as_json:
        _render.print_json("validate", {
            "target": report.target, "target_kind": report.kind, "ok": report.ok,
            "checks": [{"name": c.name, "ok": c.ok, "warning": c.warning, "detail": c.detail,
                        "error": c.error.to_dict() if c.error else None} for c in report.checks],
        })
    else:
        table = Table(title=escape(f"validate {report.kind}" + (f" {report.target}" if report.target else "")),
                      title_justify="left")
        table.add_column("check")
        table.add_column("")
        table.add_column("detail", overflow="fold")
        for c in report.checks:
            verdict = "[red]FAIL[/]" if not c.ok else "[yellow]warn[/]" if c.warning else "[green]ok[/]"
            table.add_row(Text(_render.one_line(c.name)), verdict, Text(_render.one_line(detail(c))))
        _render.stdout.print(table)
    error = report.first_error
    if error is not None:
        if not as_json:
            _render.print_error(error, False)
        raise typer.Exit(code=error.exit_code)
