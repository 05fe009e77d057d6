"""An instance's metrics file goes with the instance, whoever stops it (hostile pass 14).

`vsnap stop` run without VSNAP_METRICS_DIR (another shell, a `kubectl exec`) left the stopped
instance's `vsnap-<instance>.prom` behind, and a cold-started instance under `vsnap serve` had no
record at all (`vsnap ps` and `vsnap stop` did not see it). The record now names the directory
its file was written into. The real CLI, real CRIU, the CPU engine.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from tests.conftest import VSNAP, engine_processes
from tests.integration.conftest import CapturedImage, write_spec
from tests.integration.test_serve import ps_instances, read_events

pytestmark = pytest.mark.criu

METRICS = "VSNAP_METRICS_DIR"


def without_metrics() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != METRICS}


def stop(instance_id: str) -> None:
    """`vsnap stop INSTANCE` from an environment without VSNAP_METRICS_DIR."""
    result = subprocess.run([VSNAP, "stop", instance_id], capture_output=True, text=True, timeout=120,
                            env=without_metrics())
    assert result.returncode == 0, result.stderr


def test_a_restored_instances_metrics_go_when_stopped_without_the_variable(captured: CapturedImage,
                                                                             tmp_path: Path) -> None:
    textfile = tmp_path / "textfile"
    restored = subprocess.run([VSNAP, "restore", str(captured.image), "--port", "0", "--detach", "--json"],
                              capture_output=True, text=True, timeout=240, env={**os.environ, METRICS: str(textfile)})
    assert restored.returncode == 0, restored.stderr
    instance = json.loads(restored.stdout)["instance"]
    assert (textfile / f"vsnap-{instance}.prom").is_file()
    [record] = [i for i in ps_instances() if i["id"] == instance]
    assert record["metrics_dir"] == str(textfile)
    stop(instance)
    assert list(textfile.iterdir()) == []
    assert engine_processes(captured.control_dir) == []


def test_a_cold_instance_under_serve_is_listed_stopped_and_its_metrics_go(tmp_path: Path) -> None:
    spec = write_spec(tmp_path, "serve-cold-metrics")
    textfile = tmp_path / "textfile"
    process = subprocess.Popen([VSNAP, "serve", str(spec), "--port", "0"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env={**os.environ, METRICS: str(textfile)})
    try:
        ready = read_events(process.stdout, "ready")[-1]  # type: ignore[arg-type]
        assert ready["how"] == "cold"
        [record] = [i for i in ps_instances() if i["url"] == ready["url"]]
        assert record["id"].startswith("cold-") and record["state"] == "serving" and record["tree"]["pid"] == ready["pid"]
        assert (textfile / f"vsnap-{record['id']}.prom").is_file()
        stop(record["id"])
        _, stderr = process.communicate(timeout=60)  # its server is gone: vsnap serve ends (exit 6)
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=60)
    assert process.returncode == 6 and "the cold server exited" in stderr, stderr
    assert list(textfile.iterdir()) == []
    assert [i for i in ps_instances() if i["url"] == ready["url"]] == []
    assert engine_processes(tmp_path / "control" / "serve-cold-metrics", launching=True) == []
