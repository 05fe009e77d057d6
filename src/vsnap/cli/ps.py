"""vsnap ps"""

from __future__ import annotations

import typer
from rich.table import Table

from .._instances import running_instances, uptime
from . import _render
from . import app, error_boundary


@app.command(help="List running restored instances: id, image, GPU, URL, pid, uptime.")
@error_boundary
def ps(as_json: bool = typer.Option(False, "--json", help="print one JSON document on stdout")) -> None:
    records = running_instances()
    if as_json:
        _render.print_json("ps", {"instances": [{**r.model_dump(mode="json"), "uptime_s": uptime(r)} for r in records]})
        return
    table = Table(title_justify="left")
    for column in ("id", "image", "gpu", "url", "pid", "uptime"):
        table.add_column(column)
    for r in records:
        table.add_row(r.id, r.image, r.gpu or "-", r.url, str(r.pid), f"{uptime(r):.0f} s")
    _render.stdout.print(table)
