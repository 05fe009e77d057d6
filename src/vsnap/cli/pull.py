"""vsnap pull REF [--to DIR]"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from . import _app as app
from . import _render, error_boundary


@app.command(help="Pull REF (REGISTRY/REPOSITORY[:TAG] or ...@sha256:DIGEST) from an OCI registry into a new "
                  "image directory: every blob and file checked, published only when complete; an "
                  "interrupted pull resumes.")
@error_boundary
def pull(
    ref: str = typer.Argument(..., help="REGISTRY/REPOSITORY[:TAG] or REGISTRY/REPOSITORY@sha256:DIGEST"),
    to: Optional[Path] = typer.Option(None, "--to", help="image directory (default: "
                                                         "/var/lib/vsnap/images/<the repository's last part>)"),
    force: bool = typer.Option(False, "--force", help="replace an existing image there once the pulled one is "
                                                      "complete"),
    insecure: bool = typer.Option(False, "--insecure", help="speak plain http to a registry that is not on "
                                                            "127.0.0.1 or localhost (those always get http)"),
    jobs: Optional[int] = typer.Option(None, "--jobs", min=1, max=64, help="blobs fetched at once (default: 4)"),
    parts: Optional[int] = typer.Option(None, "--parts", min=1, max=64, help="byte ranges a large raw layer (the "
                                        "weights file) is fetched in, side by side (default: VSNAP_PULL_PARTS, "
                                        "else 4; 1: one stream)"),
    model_dir: Optional[Path] = typer.Option(None, "--model-dir", help="also put the model's files the image was "
                                             "pushed with (`vsnap push --model`) into this directory, which must be "
                                             "the one the image records; files already there are kept if they are "
                                             "the image's, never replaced"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON document on stdout"),
) -> None:
    from vsnap.registry import pull as _pull  # here, not at import: every vsnap command loads every command module

    progress = _render.PhaseProgress()
    try:
        result = _pull.pull_image(ref, to=to, force=force, insecure=insecure, on_event=progress, parts=parts,
                                   model_dir=model_dir,
                                   **({'jobs': jobs} if jobs else {}))
    finally:
        progress.close()
    if as_json:
        _render.print_json("pull", {
            "image": str(result.image_dir), "reference": result.reference, "digest": result.digest,
            "files": result.files, "downloaded": result.downloaded, "reused": result.reused, "ranged": result.ranged,
            "bytes_received": result.bytes_received, "image_bytes": result.image_bytes,
            "model_dir": str(result.model_dir) if result.model_dir else None, "model_files": result.model_files,
            "model_fetched": result.model_fetched, "model_bytes": result.model_bytes,
            "model_bytes_received": result.model_bytes_received, "image_was_there": result.image_was_there,
            "timings": result.timings, "total_s": sum(result.timings.values()),
        })
        return
    _render.stdout.print(_render.timing_table(f"pulled {result.reference}", result.timings))
    if result.image_was_there:
        _render.stdout.print(f"image: {result.image_dir} was there already (the same manifest.json), kept as it is",
                             markup=False)
    else:
        _render.stdout.print(f"image: {result.image_dir} ({result.image_bytes / 1e6:.1f} MB; {result.downloaded} "
                             f"blobs fetched, {result.bytes_received / 1e6:.1f} MB, {result.reused} kept from an "
                             "interrupted pull)", markup=False)
    if result.model_dir is not None:
        _render.stdout.print(f"model: {result.model_dir} ({result.model_files} files, {result.model_bytes / 1e6:.1f} "
                             f"MB; {result.model_fetched} fetched, {result.model_bytes_received / 1e6:.1f} MB, the "
                             "others were there)", markup=False)
    elif result.model_files:
        _render.stdout.print(f"model: not pulled ({result.model_files} files, {result.model_bytes / 1e6:.1f} MB, "
                             f"in the registry); the image says its model lives in {result.model_recorded}: "
                             "if that is where this host keeps it and the model is not there yet, pull again "
                             "with --model-dir and that directory (the image, already here, is kept)",
                             markup=False)
