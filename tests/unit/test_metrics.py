"""Restore timings in Prometheus' text format for a node exporter's textfile collector."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from vsnap.host import metrics


def test_off_unless_a_directory_is_named(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(metrics.METRICS_DIR_ENV, raising=False)
    assert metrics.write_instance_metrics("r-00000001", "llama", "restored", {"criu restore": 0.3}) is None
    monkeypatch.setenv(metrics.METRICS_DIR_ENV, "relative/dir")  # only an absolute path counts
    assert metrics.metrics_dir() is None
    assert list(tmp_path.iterdir()) == []


def test_one_file_per_instance_written_then_removed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    directory = tmp_path / "textfile"
    monkeypatch.setenv(metrics.METRICS_DIR_ENV, str(directory))
    path = metrics.write_instance_metrics("r-00000001", 'll"a\\ma\n', "restored",
                                          {"criu restore": 0.25, "recover": 0.5, "bad": float("nan")})
    assert path == directory / "vsnap-r-00000001.prom"
    text = path.read_text()
    labels = 'instance="r-00000001",image="ll\\"a\\\\ma\\n",how="restored"'
    assert f'vsnap_restore_phase_seconds{{{labels},phase="criu restore"}} 0.250000' in text
    assert f"vsnap_restore_seconds{{{labels}}} 0.750000" in text  # a NaN is left out, not summed
    assert f"vsnap_serve_fallback{{{labels}}} 0" in text
    assert "# TYPE vsnap_restore_seconds gauge" in text and 'phase="bad"' not in text
    assert os.stat(directory).st_mode & 0o077 == 0  # root's own directory
    metrics.remove_instance_metrics("r-00000001")
    assert not path.exists()
    metrics.remove_instance_metrics("r-00000001")  # twice: nothing to do


def test_a_link_at_the_file_name_is_replaced_not_followed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    directory = tmp_path / "textfile"
    directory.mkdir(mode=0o700)
    victim = tmp_path / "victim"
    victim.write_text("keep")
    (directory / "vsnap-r-00000002.prom").symlink_to(victim)
    monkeypatch.setenv(metrics.METRICS_DIR_ENV, str(directory))
    metrics.write_instance_metrics("r-00000002", "m", "cold", {"boot engine": 3.0}, fallback=True)
    assert victim.read_text() == "keep"
    assert "vsnap_serve_fallback" in (directory / "vsnap-r-00000002.prom").read_text()
    metrics.remove_instance_metrics("r-00000002")
    assert victim.read_text() == "keep"


def test_a_directory_that_is_not_roots_alone_leaves_metrics_out(monkeypatch: pytest.MonkeyPatch,
                                                                 tmp_path: Path) -> None:
    """Best effort: a monitoring setting never fails a restore (hostile pass 13: a directory of
    another user's made `vsnap serve` fall back to cold, then fail)."""
    directory = tmp_path / "theirs"
    directory.mkdir(mode=0o755)
    os.chown(directory, 65534, 65534)
    monkeypatch.setenv(metrics.METRICS_DIR_ENV, str(directory))
    assert metrics.write_instance_metrics("r-00000003", "m", "restored", {"recover": 1.0}) is None
    assert list(directory.iterdir()) == []
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "elsewhere")
    monkeypatch.setenv(metrics.METRICS_DIR_ENV, str(link))
    assert metrics.write_instance_metrics("r-00000003", "m", "restored", {"recover": 1.0}) is None
