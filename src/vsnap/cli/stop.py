"""vsnap stop IMAGE|INSTANCE"""

from __future__ import annotations

from pathlib import Path

import typer

from . import _app as app
from . import _render, error_boundary


@app.command(help="Stop running restored instances: every instance of IMAGE, or the one INSTANCE id (vsnap ps). "
                  "Exits 9 when nothing runs, 10 when no running instance matches.")
@error_boundary
def stop(
    target: str = typer.Argument(..., help="image directory or instance id"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON document on stdout"),
) -> None:
    # here, not at import: every vsnap command loads every command module
    from vsnap.host.instances import running_instances
    from vsnap.ops.stop import stop_server
    from vsnap.protocol.errors import NothingRunning, UnknownInstance

    running = running_instances()
    if not running:
        raise NothingRunning(f"no vsnap instance is running (nothing to stop for {target})")
    image = str(Path(target).absolute())
    chosen = [r for r in running if target == r.id or image == r.image]
    if not chosen:
        ids = ", ".join(r.id for r in running[:5]) + (f" and {len(running) - 5} more" if len(running) > 5 else "")
        raise UnknownInstance(target, hint=f"running: {ids} (vsnap ps shows them)")
    for record in chosen:
        stop_server(record)
    if as_json:
        _render.print_json("stop", {"stopped": [{"id": r.id, "pid": r.pid} for r in chosen]})
    else:
        for record in chosen:
            _render.stdout.print(f"stopped {record.id} (pid {record.pid})", markup=False)
