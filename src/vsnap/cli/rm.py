"""vsnap rm IMAGE"""

from __future__ import annotations

from dataclasses import asdict

import typer

from . import _app as app
from . import _render, error_boundary
from .images import human_size


@app.command(help="Remove an image vsnap made (IMAGE: its directory, or a bare NAME for /var/lib/vsnap/images/NAME). "
                  "Refused (exit 4) while an instance restored from it runs, while a capture or restore holds "
                  "its locks, and for anything that is not a vsnap image of root's alone; only the files its "
                  "manifest lists are deleted.")
@error_boundary
def rm(
    image: str = typer.Argument(..., help="image directory, or NAME under /var/lib/vsnap/images"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON document on stdout"),
) -> None:
    from vsnap.image import local as _images  # here, not at import: every vsnap command loads every command module

    removed = _images.remove_image(image)
    if as_json:
        _render.print_json("rm", {"removed": asdict(removed)})
        return
    for leftover in removed.finished:
        _render.stdout.print(f"finished an interrupted removal: {leftover}", markup=False)
    if removed.name is not None:
        _render.stdout.print(f"removed {removed.path} ({removed.files} files, {human_size(removed.size_bytes)})",
                             markup=False)
