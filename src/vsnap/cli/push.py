"""vsnap push IMAGE REF"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from . import _app as app
from . import _render, error_boundary


@app.command(help="Push IMAGE to an OCI registry as REF (REGISTRY/REPOSITORY[:TAG]). Blobs the registry "
                  "already holds are not sent again, so an interrupted push resumes.")
@error_boundary
def push(
    image: Path = typer.Argument(..., help="image directory"),
    ref: str = typer.Argument(..., help="REGISTRY/REPOSITORY[:TAG] (TAG defaults to latest)"),
    insecure: bool = typer.Option(False, "--insecure", help="speak plain http to a registry that is not on "
                                                            "127.0.0.1 or localhost (those always get http)"),
    jobs: Optional[int] = typer.Option(None, "--jobs", min=1, max=64, help="blobs sent at once (default: 4)"),
    model: bool = typer.Option(False, "--model", help="also push the files of the image's model directory (one "
                                                      "blob each, shared by every image of the model), so that a "
                                                      "node without the model can pull it with the image"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON document on stdout"),
) -> None:
    from vsnap.registry import push as _push  # here, not at import: every vsnap command loads every command module

    progress = _render.PhaseProgress()
    try:
        result = _push.push_image(image, ref, insecure=insecure, model=model, on_event=progress,
                                   **({'jobs': jobs} if jobs else {}))
    finally:
        progress.close()
    seconds = sum(result.timings.values())
    if as_json:
        _render.print_json("push", {
            "image": str(result.image_dir), "reference": result.reference, "digest": result.digest,
            "blobs": result.blobs, "uploaded": result.uploaded, "skipped": result.skipped,
            "bytes_sent": result.bytes_sent, "bytes_skipped": result.bytes_skipped, "image_bytes": result.image_bytes,
            "model_files": result.model_files, "model_bytes": result.model_bytes,
            "timings": result.timings, "total_s": seconds,
        })
        return
    _render.stdout.print(_render.timing_table(f"pushed {result.image_dir}", result.timings))
    _render.stdout.print(f"{result.reference}: {result.blobs} blobs, {result.uploaded} sent "
                         f"({result.bytes_sent / 1e6:.1f} MB), {result.skipped} already there "
                         f"({result.bytes_skipped / 1e6:.1f} MB); image {result.image_bytes / 1e6:.1f} MB"
                         + (f", model {result.model_files} files, {result.model_bytes / 1e6:.1f} MB"
                            if result.model_files else ""), markup=False)
