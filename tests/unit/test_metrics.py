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


def test_forgetting_an_instance_removes_its_file_where_its_record_says(monkeypatch: pytest.MonkeyPatch,
                                                                         tmp_path: Path) -> None:
    """Hostile pass 14: `vsnap stop` without VSNAP_METRICS_DIR (another shell, a `kubectl exec`) left
    the stopped instance's file for ever. The record names the directory its file was written into."""
    import time

    from vsnap.host import instances

    monkeypatch.setattr(instances, "RUNTIME_DIR", tmp_path / "run")
    directory = tmp_path / "textfile"
    monkeypatch.setenv(metrics.METRICS_DIR_ENV, str(directory))
    written = metrics.write_instance_metrics("r-00000004", "m", "restored", {"recover": 1.0})
    assert written is not None
    record = instances.InstanceRecord(id="r-00000004", image="/i", name="m", state="serving",
                                      owner=instances.this_process(), started_at=time.time(),
                                      instance_dir=str(tmp_path / "c.instances" / "r-00000004"),
                                      metrics_dir=str(written.parent))
    instances.register(record)
    monkeypatch.delenv(metrics.METRICS_DIR_ENV)  # the stopping command's own environment has none
    instances.unregister("r-00000004")
    assert not written.exists() and list(directory.iterdir()) == []
    with pytest.raises(ValueError, match="metrics_dir must be an absolute path"):
        record.model_copy(update={"metrics_dir": "relative/dir"})


def test_a_recorded_directory_that_is_not_roots_alone_is_left_as_it_is(tmp_path: Path) -> None:
    """The record is root's, but what it names may have changed since: a directory another user
    can write (or a link put in its place) is not acted on."""
    directory = tmp_path / "textfile"
    directory.mkdir(mode=0o700)
    (directory / "vsnap-r-00000005.prom").write_text("x")
    os.chmod(directory, 0o777)
    metrics.remove_instance_metrics("r-00000005", directory)
    assert (directory / "vsnap-r-00000005.prom").exists()
    os.chmod(directory, 0o700)
    link = tmp_path / "link"
    link.symlink_to(directory)
    metrics.remove_instance_metrics("r-00000005", link)
    assert (directory / "vsnap-r-00000005.prom").exists()
    metrics.remove_instance_metrics("r-00000005", directory)
    assert list(directory.iterdir()) == []
