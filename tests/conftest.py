"""Shared fixtures. Tests that need CRIU and root are marked `criu`: they skip with the host's reason
on a developer machine, and fail instead of skipping in CI (CI=true), where they must run."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

VSNAP = str(Path(sys.executable).with_name("vsnap"))


def criu_unavailable_reason() -> str | None:
    from vsnap.host.facts import check_criu, check_root
    from vsnap.protocol.errors import VsnapError

    try:
        check_root()
        check_criu()
    except VsnapError as exc:
        return exc.message
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not any(item.get_closest_marker("criu") for item in items):
        return
    reason = criu_unavailable_reason()
    if reason is not None and os.environ.get("CI"):
        raise pytest.UsageError(f"CI must run the CRIU tests, but this host cannot: {reason}")
    if reason is not None:
        for item in items:
            if item.get_closest_marker("criu"):
                item.add_marker(pytest.mark.skip(reason=reason))
        return
    short = temp_space_shortfall(config.option.basetemp)
    if short:
        raise pytest.UsageError(short)


# The most the CRIU tests hold in the temp directory at once, with room to spare: `make test`
# peaked at 1.7 GB in the main suite and 2.7 GB in tests/vllm_cpu (2026-12-02, sampled every 3 s).
TEMP_SPACE_NEEDED = 4 << 30


def temp_space_shortfall(basetemp: str | None) -> str | None:
    """A line naming the shortfall when the file system of pytest's temp directory (``basetemp``
    or TMPDIR's) has too little room for the CRIU tests; with less, they fail one after another on
    a full disk, pytest's own files too."""
    directory = Path(basetemp).resolve() if basetemp else Path(tempfile.gettempdir())
    while not directory.exists():
        directory = directory.parent
    free = shutil.disk_usage(directory).free
    if free >= TEMP_SPACE_NEEDED:
        return None
    return (f"the CRIU tests need {TEMP_SPACE_NEEDED / 2**30:.0f} GiB free in {directory} and it has "
            f"{free / 2**30:.1f} GiB: free some space there or point TMPDIR at a larger file system")


def engine_processes(control_dir: Path, *, launching: bool = False) -> list[int]:
    """PIDs of engine trees that use ``control_dir`` (what a test must find none of). With
    ``launching``, also the `unshare` and `sh` a tree starts from, before its root execs the engine."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            status = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        ours = b"vsnap.engine" in cmdline or (launching and any(b"vsnap.engine" in arg for arg in cmdline))
        if status != "Z" and ours and str(control_dir).encode() in cmdline:
            found.append(int(entry))
    return found
