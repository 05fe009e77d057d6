"""vsnap inspect IMAGE"""

from __future__ import annotations

from pathlib import Path

import typer
from rich.markup import escape
from rich.table import Table

from . import _app as app
from . import _render, error_boundary


@app.command(help="Show what an image holds (reads manifest.json only).")
@error_boundary
def inspect(
    image: Path = typer.Argument(..., help="image directory"),
    as_json: bool = typer.Option(False, "--json", help="print the manifest as JSON"),
) -> None:
    # here, not at import: every vsnap command loads every command module
    from vsnap.image.handle import open_image
    from vsnap.image.manifest import WEIGHTS_DIR

    manifest = open_image(image, trusted=False, lock=False).manifest  # shown, never acted on
    if as_json:
        _render.print_json("inspect", {"image": str(image), "manifest": manifest.model_dump(mode="json")})
        return
    table = Table(title=escape(_render.one_line(f"image {image}")), title_justify="left", show_header=False)
    table.add_column("key")
    table.add_column("value", overflow="fold")
    h = manifest.host
    rows = [
        ("name", manifest.name), ("engine", manifest.engine), ("model", manifest.launch.model),
        ("created", manifest.created_at), ("host", f"{h.hostname}: {h.arch}, kernel {h.kernel}, criu {h.criu}"),
        ("software", f"python {h.python}, torch {h.torch}, vllm {h.vllm or '-'}, vsnap {h.vsnap}"),
        ("size", f"{manifest.sizes.get('image_bytes', 0) / 1e6:.1f} MB in {len(manifest.files)} files"),
        ("control dir", manifest.control_dir),
        ("oracle", f"{len(manifest.oracle.samples)} prompts x {manifest.launch.oracle_max_tokens} tokens, "
                   f"top-{manifest.launch.oracle_top_k}, tolerance {manifest.launch.oracle_tolerance:g}"),
        ("depends on", f"{len(manifest.dependencies)} host files, {model_line(manifest.model_files())}"),
        ("capture", ", ".join(f"{k} {v:.2f}s" for k, v in manifest.timings.items())),
    ]
    weights = sum(e.size for rel, e in manifest.files.items() if rel.startswith(WEIGHTS_DIR + "/"))
    if weights:
        rows.insert(7, ("weights file", f"{weights / 1e6:.1f} MB (streamed back at restore)"))
    rows += [(f"process {p.get('pid', '?')}", process_line(p)) for p in manifest.processes if isinstance(p, dict)]
    for key, value in rows:  # both cells from the manifest (a process's pid too): one line, never markup
        table.add_row(escape(_render.one_line(key)), escape(_render.one_line(value)))
    _render.stdout.print(table)


def model_line(files: dict) -> str:
    """The model's share of the dependencies: what `vsnap push --model` sends beside the image."""
    return f"{len(files)} of them the model's ({sum(dep.size for dep in files.values()) / 1e6:.1f} MB)"


def process_line(process: dict) -> str:
    """One process of the tree at the dump: what it adds to the image (and moved off the GPU).
    Read defensively: the manifest may come from anyone (inspect runs no trust check)."""
    def number(value: object) -> float:
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0

    gpu = f", {number(process.get('gpu_bytes')) / 1e6:.0f} MB on the GPU before the checkpoint" \
        if "gpu_bytes" in process else ""
    mappings = process.get("largest_mappings")
    largest = ", ".join(f"{m.get('name', '?')} {number(m.get('bytes')) / 1e6:.0f} MB"
                        for m in (mappings if isinstance(mappings, list) else [])[:3] if isinstance(m, dict))
    return (f"{str(process.get('command', '?'))[:60]}: {number(process.get('anonymous_bytes')) / 1e6:.0f} MB "
            f"anonymous{gpu}" + (f" (largest: {largest})" if largest else ""))
