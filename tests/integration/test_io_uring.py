"""A CPU tree runs under the io_uring filter (engine/seccomp.py), and CRIU carries the filter
through the dump and the restore: the restored processes still cannot make an io_uring."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.conftest import CapturedImage
from vsnap import restore_image, stop_server
from vsnap.host.proctree import tree_pids

pytestmark = pytest.mark.criu


def seccomp_mode(pid: int) -> str:
    status = Path(f"/proc/{pid}/status").read_text()
    return status.split("Seccomp:", 1)[1].split()[0]


def test_the_restored_tree_keeps_its_io_uring_filter(captured: CapturedImage) -> None:
    assert "io_uring_setup blocked for the tree" in (captured.image / "logs" / "engine.log").read_text()
    server = restore_image(captured.image, port=0)
    try:
        pids = tree_pids(server.pid)
        assert len(pids) >= 2  # the root and its worker
        assert {seccomp_mode(pid) for pid in pids} == {"2"}  # filter mode, in every process
    finally:
        stop_server(server)
