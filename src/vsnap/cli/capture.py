"""vsnap capture SPEC"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import typer

from . import _app as app
from . import _render, error_boundary


@app.command(help="Boot the engine of SPEC (a model.yaml), checkpoint it at its barrier and publish the image.")
@error_boundary
def capture(
    spec: Path = typer.Argument(..., help="model.yaml"),
    image: Optional[Path] = typer.Option(None, "--image", help="image directory (default: the spec's)"),
    force: bool = typer.Option(False, "--force", help="replace an existing image once the new one is complete"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON document on stdout"),
) -> None:
    # here, not at import: every vsnap command loads every command module
    from vsnap.ops.capture import capture_image
    from vsnap.spec.schema import load_spec

    # --image goes through the spec's own checks (absolute, no system directory, apart from the control dir)
    override = {"image": os.path.abspath(image)} if image is not None else None
    model_spec = load_spec(spec, overrides=override)
    progress = _render.PhaseProgress()
    try:
        result = capture_image(model_spec, image_dir=model_spec.image_dir, force=force, on_event=progress)
    finally:
        progress.close()
    if as_json:
        _render.print_json("capture", {
            "image": str(result.image_dir), "image_bytes": result.image_bytes, "timings": result.timings,
            "oracle": result.manifest.oracle.model_dump(mode="json"), "engine_log": str(result.engine_log),
        })
        return
    _render.stdout.print(_render.timing_table(f"captured {result.image_dir}", result.timings))
    _render.stdout.print(f"image: {result.image_dir} ({result.image_bytes / 1e6:.1f} MB)", markup=False)
