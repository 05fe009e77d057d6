"""vsnap stop IMAGE|INSTANCE"""

from __future__ import annotations

from pathlib import Path

import typer

from .. import _restore
from ..protocol.errors import ProcessTreeError
from .._instances import running_instances
from . import _render
from . import app, error_boundary


@app.command(help="Stop running restored instances: every instance of IMAGE, or the one INSTANCE id (vsnap ps).")
@error_boundary
def stop(
    target: str = typer.Argument(..., help="image directory or instance id"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON document on stdout"),
) -> None:
    image = str(Path(target).absolute())
    chosen = [r for r in running_instances() if target == r.id or image == r.image]
    if not chosen:
        raise ProcessTreeError(None, f"no running instance of {target}", phase="stop", hint="vsnap ps lists them")
    for record in chosen:
        _restore.stop_server(record)
    if as_json:
        _render.print_json("stop", {"stopped": [{"id": r.id, "pid": r.pid} for r in chosen]})
    else:
        for record in chosen:
            _render.stdout.print(f"stopped {record.id} (pid {record.pid})")
