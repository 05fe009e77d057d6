"""Running instances: each restore gets its own directory at the tree's control path, and a record.

The tree refers to its control directory (control files, engine log, vLLM's IPC sockets) by one
path, the spec's `snapshot.control_dir`. Inside the tree's mount namespace that path is a bind
mount of a host directory, declared external to CRIU: the capture binds one directory there, and
each restore binds a fresh one (`<control_dir>.instances/<id>`). So any number of restores of one
image run at once, each with its own files, PID namespace, GPU and port.

Records of running instances live in RUNTIME_DIR/instances/<id>.json (`vsnap ps`, `vsnap stop`).
"""

from __future__ import annotations

import os
import secrets
import shutil
import stat
import time
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from .protocol import control
from ._proctree import alive

RUNTIME_DIR = Path(os.environ.get("VSNAP_RUNTIME_DIR", "/run/vsnap"))


class InstanceRecord(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str
    image: str
    name: str
    pid: int
    url: str
    port: int
    gpu: str | None = None
    instance_dir: str
    started_at: float


# A failed capture or restore keeps its directory (the logs its error names) this long.
KEEP_FAILED_S = 3 * 24 * 3600


def new_instance_dir(control_dir: Path, prefix: str) -> tuple[str, Path]:
    """A fresh private host directory to bind at ``control_dir`` inside one tree (old directories
    of failed runs beside it are removed on the way)."""
    instance_id = f"{prefix}-{secrets.token_hex(4)}"
    root = Path(f"{control_dir}.instances")
    control.ensure_private_dir(root)
    prune_failed(root)
    return instance_id, control.ensure_private_dir(root / instance_id)


def prune_failed(root: Path, keep_s: float = KEEP_FAILED_S) -> list[str]:
    """Remove instance directories untouched for ``keep_s`` that no running instance uses."""
    in_use = {Path(r.instance_dir).name for r in running_instances()}
    removed = []
    for entry in root.iterdir():
        try:
            st = entry.lstat()
        except OSError:
            continue
        if entry.name in in_use or not stat.S_ISDIR(st.st_mode) or time.time() - st.st_mtime < keep_s:
            continue
        shutil.rmtree(entry, ignore_errors=True)
        removed.append(entry.name)
    return removed


def registry_dir() -> Path:
    return control.ensure_private_dir(RUNTIME_DIR / "instances")


def register(record: InstanceRecord) -> None:
    control.write_message(registry_dir(), f"{record.id}.json", record)


def unregister(instance_id: str) -> None:
    try:
        os.unlink(registry_dir() / f"{instance_id}.json")
    except FileNotFoundError:
        pass


def running_instances() -> list[InstanceRecord]:
    """Records whose tree is alive; records of ended trees are removed on the way."""
    directory = registry_dir()
    records = []
    for path in sorted(directory.glob("*.json")):
        try:
            record = control.read_message(directory, path.name, InstanceRecord)
        except Exception:
            continue
        if record is None:
            continue
        if alive(record.pid):
            records.append(record)
        else:
            unregister(record.id)
    return records


def uptime(record: InstanceRecord) -> float:
    return time.time() - record.started_at
