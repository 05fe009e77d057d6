"""`vsnap serve`, the entrypoint that always serves: the real CLI, real CRIU, the CPU engine.

Each run reads the JSON events from stdout until "ready", asks the served port for a completion,
then sends SIGTERM: a clean stop (exit 0, a "stopped" event, no engine left, the ready file gone)."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import time
from pathlib import Path
from typing import IO, Any

import pytest

from tests.conftest import VSNAP, engine_processes
from tests.integration.conftest import write_spec
from tests.integration.test_cpu_roundtrip import complete

pytestmark = pytest.mark.criu


def read_events(stream: IO[str], until: str, timeout_s: float = 240) -> list[dict[str, Any]]:
    """JSON lines from ``stream`` up to and including the first event ``until``."""
    events: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not select.select([stream], [], [], 1.0)[0]:
            continue
        line = stream.readline()
        if not line:
            break
        events.append(json.loads(line))
        if events[-1]["event"] == until:
            return events
    raise AssertionError(f"no {until!r} event; got {events}")


def serve_once(spec: Path, tmp_path: Path, *args: str) -> list[dict[str, Any]]:
    """One `vsnap serve` from start to SIGTERM; its events."""
    ready_file = tmp_path / "probe" / "ready"
    metrics_dir = tmp_path / "textfile"  # a node exporter's textfile collector would read it
    process = subprocess.Popen([VSNAP, "serve", str(spec), "--port", "0", "--ready-file", str(ready_file), *args],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "VSNAP_METRICS_DIR": str(metrics_dir)})
    try:
        events = read_events(process.stdout, "ready")  # type: ignore[arg-type]
        ready = events[-1]
        assert ready_file.read_text().strip() == ready["url"]
        assert complete(ready["url"], "after the start", 3, 1)["token_ids"]
        exported = "".join(p.read_text() for p in metrics_dir.glob("vsnap-*.prom"))
        assert f'how="{ready["how"]}"' in exported
        assert f'vsnap_serve_fallback{{' in exported and exported.count("vsnap_restore_seconds{") == 1
        assert ("} 1\n" in exported.split("vsnap_serve_fallback")[-1]) == (ready["how"] == "cold")
        if ready["how"] == "restored":  # `vsnap ps --json` has the restore's phases
            listed = json.loads(subprocess.run([VSNAP, "ps", "--json"], capture_output=True, text=True,
                                               check=True).stdout)["instances"]
            assert "criu restore" in next(i for i in listed if i["url"] == ready["url"])["timings"]
        process.send_signal(signal.SIGTERM)
        rest, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0, stderr
    assert [json.loads(line)["event"] for line in rest.splitlines()] == ["stopped"]
    assert not ready_file.exists()
    assert list(metrics_dir.glob("vsnap-*.prom")) == []  # removed with the instance
    return events


def test_serve_starts_cold_without_an_image_and_says_why(tmp_path: Path) -> None:
    spec = write_spec(tmp_path, "serve-cold")
    events = serve_once(spec, tmp_path)
    fallback = [e for e in events if e["event"] == "fallback"]
    assert len(fallback) == 1 and fallback[0]["reason"].startswith("no image at ")
    assert events[-1]["how"] == "cold" and events[-1]["fallback"] == fallback[0]["reason"]
    assert {"launch", "boot engine", "first completion"} <= {e["phase"] for e in events if e["event"] == "phase"}
    assert engine_processes(tmp_path / "control" / "serve-cold") == []
    assert not (tmp_path / "images" / "serve-cold").exists()  # no capture unless asked


def test_serve_captures_then_restores_and_falls_back_from_a_broken_image(tmp_path: Path) -> None:
    spec = write_spec(tmp_path, "serve-capture")
    control_dir = tmp_path / "control" / "serve-capture"
    image = tmp_path / "images" / "serve-capture"

    events = serve_once(spec, tmp_path, "--capture")  # no image: captured, then restored
    assert [e["event"] for e in events if e["event"] in ("capture", "fallback")] == ["capture"]
    assert events[-1]["how"] == "restored" and events[-1]["fallback"] is None
    assert (image / "manifest.json").is_file() and engine_processes(control_dir) == []

    events = serve_once(spec, tmp_path)  # the next start restores, without a capture
    assert [e["event"] for e in events if e["event"] in ("capture", "fallback")] == []
    assert events[-1]["how"] == "restored"

    pages = sorted((image / "criu").glob("pages-*.img"))[0]
    with open(pages, "r+b") as f:  # one byte of the tree's memory changed: the restore refuses it
        first = f.read(1)
        f.seek(0)
        f.write(bytes([first[0] ^ 0xFF]))
    events = serve_once(spec, tmp_path)
    fallback = [e for e in events if e["event"] == "fallback"]
    assert len(fallback) == 1 and fallback[0]["reason"].startswith("the restore failed: ")
    assert events[-1]["how"] == "cold"
    assert engine_processes(control_dir) == []


def test_a_refused_ready_file_is_never_removed_through_another_users_link(tmp_path: Path) -> None:
    """Hostile pass 13: a --ready-file reached through a link of another user's was refused, and the
    stop then removed root's file at the link's target. Only the file vsnap wrote is removed."""
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    victim_dir = tmp_path / "victim"
    victim_dir.mkdir()
    (victim_dir / "ready").write_text("important")
    (theirs / "sub").symlink_to(victim_dir)
    os.chown(theirs, 65534, 65534)
    os.lchown(theirs / "sub", 65534, 65534)
    spec = write_spec(tmp_path, "serve-refused")
    result = subprocess.run([VSNAP, "serve", str(spec), "--port", "0", "--ready-file", str(theirs / "sub" / "ready")],
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 4, result.stderr
    assert (victim_dir / "ready").read_text() == "important"
    assert engine_processes(tmp_path / "control" / "serve-refused") == []
