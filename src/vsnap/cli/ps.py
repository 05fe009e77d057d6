"""vsnap ps"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Iterable

import typer
from rich import box
from rich.table import Table
from rich.text import Text

if TYPE_CHECKING:
    from vsnap.host.instances import InstanceRecord

from . import _app as app
from . import _render, error_boundary


def compact_duration(seconds: float) -> str:
    """42s, 5m03s, 2h05m, 3d04h: at most 6 characters."""
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def short_gpu(gpu: str | None) -> str:
    """A GPU UUID (GPU-4ad1c6d3-1b5e-...) by its first 8 hex digits, as nvidia-smi -L can be grepped."""
    if not gpu:
        return "-"
    return gpu.removeprefix("GPU-")[:8]


def address(url: str) -> str:
    """host:port of an http URL (127.0.0.1:8000, [::1]:8000), https:// kept (the table's width;
    JSON keeps the URL)."""
    return url.removeprefix("http://").rstrip("/") or "-"


def ps_table(running: Iterable[InstanceRecord], gone: Iterable[InstanceRecord] = (),
             now: float | None = None) -> Table:
    """The instances, readable at 80 columns: the image path wraps, the rest stays on one line."""
    now = time.time() if now is None else now
    table = Table(box=box.SIMPLE_HEAD, padding=0, show_edge=False)  # one space between columns
    table.add_column("id", no_wrap=True)
    table.add_column("image", overflow="fold", min_width=16)
    table.add_column("gpu", no_wrap=True)
    table.add_column("address", overflow="fold", min_width=15)
    table.add_column("pid", justify="right", no_wrap=True)
    table.add_column("up", justify="right", no_wrap=True)
    for record in running:
        up = compact_duration(now - record.started_at) if record.state == "serving" else record.state
        table.add_row(*_cells(record), Text(_render.one_line(address(record.url))), str(record.pid), up)
    for record in gone:
        table.add_row(*_cells(record), "-", str(record.pid), Text("gone", style="dim"))
    return table


def _cells(record: InstanceRecord) -> tuple[Text, Text, Text]:
    """id, image and GPU as plain Text (never read as markup or :emoji: codes), each on one line: a
    record is root's but still input, and must not forge a row."""
    return (Text(record.id), Text(_render.one_line(record.image)), Text(_render.one_line(short_gpu(record.gpu))))


def _records() -> tuple[list[InstanceRecord], list[InstanceRecord]]:
    """(running, gone): a record whose processes ended or whose PID now belongs to another process
    is gone: shown once, then pruned by the registry."""
    from vsnap.host.instances import instance_records  # not at import: every vsnap command loads every command module

    return instance_records()


@app.command(help="List restored instances: id, image, GPU, address, pid, uptime (or restoring, gone); "
                  "--json has the full URLs.")
@error_boundary
def ps(as_json: bool = typer.Option(False, "--json", help="print one JSON document on stdout")) -> None:
    from vsnap.host.instances import uptime  # here, not at import: every vsnap command loads every command module

    running, gone = _records()
    if as_json:
        _render.print_json("ps", {
            "instances": [{**r.model_dump(mode="json"), "uptime_s": uptime(r)} for r in running],
            "gone": [r.model_dump(mode="json") for r in gone],
        })
        return
    if not running and not gone:
        _render.stderr.print("no vsnap instance is running")
        return
    _render.stdout.print(ps_table(running, gone))
