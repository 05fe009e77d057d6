"""vsnap images [DIR...]"""

from __future__ import annotations

import datetime as _dt
from dataclasses import asdict
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Iterable, List, Optional

import typer
from rich import box
from rich.table import Table
from rich.text import Text

from . import _app as app
from . import _render, error_boundary

if TYPE_CHECKING:
    from vsnap.image import local as _images


def human_size(size: int) -> str:
    """328.3 MB, 17.2 GB: decimal units, at most 8 characters."""
    value = float(size)
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if value < 1000 or unit == "TB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{value:.1f} TB"


def short_time(created_at: str) -> str:
    """An ISO timestamp as YYYY-MM-DD HH:MM in UTC (the manifest's own text if it does not parse)."""
    try:
        moment = _dt.datetime.fromisoformat(created_at)
    except ValueError:
        return created_at[:16]
    if moment.tzinfo is not None:
        moment = moment.astimezone(_dt.timezone.utc)
    return moment.strftime("%Y-%m-%d %H:%M")


COLUMNS = ("name", "image", "engine", "model", "size", "created", "from")
FOLDED = {"name", "image", "model", "from"}  # the others stay on one line
MIN_FOLDED = 8


def fit_widths(natural: dict[str, int], total: int) -> dict[str, int]:
    """Column widths that fit ``total`` characters (one space between columns): the widest folded
    column gives up a character at a time, none below MIN_FOLDED. (Rich's own collapse folds a
    long cell at one width and then crops it to a narrower one, losing characters.)"""
    widths = dict(natural)
    room = total - (len(widths) - 1)
    while sum(widths.values()) > room:
        shrinkable = [c for c in FOLDED if widths[c] > MIN_FOLDED]
        if not shrinkable:
            break
        widest = max(shrinkable, key=lambda c: (widths[c], c))
        widths[widest] -= 1
    return widths


def image_row(info: _images.ImageInfo) -> dict[str, str]:
    model = PurePosixPath(info.model).name or info.model
    return {"name": info.name, "image": info.path, "engine": info.engine, "model": model,
            "size": human_size(info.disk_bytes), "created": short_time(info.created_at), "from": info.origin}


def images_table(images: Iterable[_images.ImageInfo], width: int = 80) -> Table:
    """The images in ``width`` columns: names, paths, models and references wrap, the rest stays
    on one line. Text from a manifest is cleaned of control characters and never read as markup."""
    rows = [{k: _render.one_line(v) for k, v in image_row(info).items()} for info in images]
    natural = {c: max([len(c)] + [len(r[c]) for r in rows]) for c in COLUMNS}
    widths = fit_widths(natural, width)
    table = Table(box=box.SIMPLE_HEAD, padding=0, show_edge=False)  # one space between columns
    for column in COLUMNS:
        table.add_column(column, width=widths[column], justify="right" if column == "size" else "left",
                         overflow="fold" if column in FOLDED else "ellipsis", no_wrap=column not in FOLDED)
    for row in rows:
        table.add_row(*(Text(row[c]) for c in COLUMNS))
    return table


@app.command(help="List the images under /var/lib/vsnap/images (or under each DIR given, or DIR itself if it is "
                  "an image): name, path, engine, model, size (on disk), created (UTC), and where from (captured, or the registry "
                  "reference it was pulled from). Links and entries that are not root's alone are reported on "
                  "stderr, never followed or listed.")
@error_boundary
def images(
    dirs: Optional[List[Path]] = typer.Argument(None, help="directories of images, or images"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON document on stdout"),
) -> None:
    from vsnap.image import local as _images  # here, not at import: every vsnap command loads every command module

    listing = _images.list_images(dirs or ())
    if as_json:
        _render.print_json("images", {
            "roots": listing.roots,
            "images": [asdict(info) for info in listing.images],
            "skipped": [asdict(entry) for entry in listing.skipped],
        })
        return
    for entry in listing.skipped:
        _render.stderr.print(f"skipped {_render.one_line(entry.path)}: {_render.one_line(entry.reason)}", markup=False)
    if not listing.images:
        _render.stderr.print(f"no vsnap image under {_render.one_line(', '.join(listing.roots))}", markup=False)
        return
    _render.stdout.print(images_table(listing.images, _render.stdout.width))
