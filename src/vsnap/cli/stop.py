"""vsnap stop IMAGE"""

from __future__ import annotations

from pathlib import Path

import typer

from .. import _restore
from .._errors import ProcessTreeError
from .._manifest import read_manifest
from . import _render
from . import app, error_boundary


@app.command(help="Stop the server restored (with --detach) from IMAGE.")
@error_boundary
def stop(
    image: Path = typer.Argument(..., help="image directory"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON document on stdout"),
) -> None:
    manifest = read_manifest(image)
    pid = _restore.running_instance(Path(manifest.control_dir))
    if pid is None:
        raise ProcessTreeError(None, f"no restored server of {image} is running", phase="stop")
    _restore.stop_server(pid)
    if as_json:
        _render.print_json("stop", {"pid": pid, "stopped": True})
    else:
        _render.stdout.print(f"stopped pid {pid}")
