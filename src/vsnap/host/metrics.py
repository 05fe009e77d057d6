"""The serving instances' restore timings in Prometheus' text format, for a node exporter's
textfile collector.

Only where ``VSNAP_METRICS_DIR`` names a directory (point it at the collector's, e.g.
`--collector.textfile.directory=/var/lib/node_exporter/textfile_collector`; docs/fleet.md): one
file per serving instance, ``vsnap-<instance>.prom``, written atomically (never through a link,
in root's own directory) once it serves and removed when it is stopped (the instance's record
names the directory, so `vsnap stop` finds the file whatever its own environment). Nothing else is
written there and nothing else is removed.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Mapping

from vsnap.protocol.control import write_atomic
from vsnap.protocol.errors import VsnapError

from .trust import make_trusted_dirs

METRICS_DIR_ENV = "VSNAP_METRICS_DIR"


def metrics_dir() -> Path | None:
    """The collector's directory, or None when metrics are off (the variable unset or empty)."""
    value = os.environ.get(METRICS_DIR_ENV, "")
    return Path(value) if value and os.path.isabs(value) else None


def _label(value: str) -> str:
    """A label value as the text format quotes it (backslash, quote and newline escaped)."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def render(instance_id: str, image: str, how: str, phases: Mapping[str, float], fallback: bool) -> str:
    """The text of one instance's file: its phases, their total, whether it fell back to cold."""
    labels = f'instance="{_label(instance_id)}",image="{_label(image)}",how="{_label(how)}"'
    finite = {name: float(seconds) for name, seconds in phases.items() if math.isfinite(float(seconds))}
    lines = ["# HELP vsnap_restore_phase_seconds Seconds each phase of the instance's start took.",
             "# TYPE vsnap_restore_phase_seconds gauge"]
    lines += [f'vsnap_restore_phase_seconds{{{labels},phase="{_label(name)}"}} {seconds:.6f}'
              for name, seconds in sorted(finite.items())]
    lines += ["# HELP vsnap_restore_seconds Seconds from the command's first phase to serving.",
              "# TYPE vsnap_restore_seconds gauge",
              f"vsnap_restore_seconds{{{labels}}} {sum(finite.values()):.6f}",
              "# HELP vsnap_serve_fallback 1 if vsnap serve started the server cold instead of restoring it.",
              "# TYPE vsnap_serve_fallback gauge",
              f"vsnap_serve_fallback{{{labels}}} {1 if fallback else 0}"]
    return "\n".join(lines) + "\n"


def write_instance_metrics(instance_id: str, image: str, how: str, phases: Mapping[str, float], *,
                           fallback: bool = False) -> Path | None:
    """Write the instance's file when metrics are on; its path, else None. Best effort: a directory
    that is not root's alone, or cannot be written, leaves metrics out and never fails a restore or
    a serve (a monitoring setting must not stop a server)."""
    directory = metrics_dir()
    if directory is None:
        return None
    name = f"vsnap-{instance_id}.prom"
    try:
        write_atomic(make_trusted_dirs(directory), name, render(instance_id, image, how, phases, fallback).encode())
    except (OSError, VsnapError):
        return None
    return directory / name


def remove_instance_metrics(instance_id: str, directory: Path | None = None) -> None:
    """Remove the instance's file from ``directory`` (the one its record names: where it was
    written, whatever this process's environment says), else from this process's metrics
    directory. Only that name; a link there is removed, not followed, and a directory that is not
    root's alone is left as it is."""
    directory = directory or metrics_dir()
    if directory is None:
        return
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:  # gone, or a link: nothing of ours to remove there
        return
    try:
        st = os.fstat(fd)
        if st.st_uid == os.geteuid() and not st.st_mode & 0o022:
            os.unlink(f"vsnap-{instance_id}.prom", dir_fd=fd)
    except OSError:  # already gone (best effort, as the writing: a monitoring setting never fails a stop)
        pass
    finally:
        os.close(fd)
