"""`vsnap serve`, the entrypoint that always serves: the real CLI, real CRIU, the CPU engine.

Each run reads the JSON events from stdout until "ready", asks the served port for a completion,
then sends SIGTERM: a clean stop (exit 0, a "stopped" event, no engine left, the ready file gone)."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import IO, Any

import pytest

from tests.conftest import VSNAP, engine_processes
from tests.integration.conftest import CapturedImage, write_spec
from tests.integration.test_cpu_roundtrip import complete

pytestmark = pytest.mark.criu


def read_events(stream: IO[str], until: str, timeout_s: float = 240) -> list[dict[str, Any]]:
    """JSON lines from ``stream`` up to and including the first event ``until`` (a "ready" or a
    "stopped" before it is a failure, as is the end of the stream)."""
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
        if events[-1]["event"] in ("ready", "stopped"):
            break
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
        assert ready_file.read_text().splitlines()[0] == ready["url"]  # then the line naming its writer
        assert complete(ready["url"], "after the start", 3, 1)["token_ids"]
        exported = "".join(p.read_text() for p in metrics_dir.glob("vsnap-*.prom"))
        assert f'how="{ready["how"]}"' in exported
        assert f'vsnap_serve_fallback{{' in exported and exported.count("vsnap_restore_seconds{") == 1
        assert ("} 1\n" in exported.split("vsnap_serve_fallback")[-1]) == (ready["how"] == "cold")
        # `vsnap ps --json` lists it, restored or cold, with the phases that brought it to serving
        [listed] = [i for i in ps_instances() if i["url"] == ready["url"]]
        assert listed["state"] == "serving" and listed["id"].startswith("r-" if ready["how"] == "restored" else "cold-")
        assert ("criu restore" if ready["how"] == "restored" else "first completion") in listed["timings"]
        assert listed["metrics_dir"] == str(metrics_dir)
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
    assert [i for i in ps_instances() if i["url"] == ready["url"]] == []  # and its record
    return events


def ps_instances() -> list[dict[str, Any]]:
    result = subprocess.run([VSNAP, "ps", "--json"], capture_output=True, text=True, check=True)
    return list(json.loads(result.stdout)["instances"])


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


def leftovers(control_dir: Path) -> list[str]:
    """Live processes whose command line names ``control_dir`` (the engine tree, its `unshare`, a
    `criu restore` of its instance directory): what a stopped serve must leave none of."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z" and str(control_dir).encode() in cmdline and entry != str(os.getpid()):
            found.append(cmdline.replace(b"\0", b" ").decode(errors="replace")[:200])
    return found


def sigterm_when(spec: Path, phase: str, *, env: dict[str, str] | None = None,
                 tree_of: Path | None = None) -> tuple[int, list[dict[str, Any]], str]:
    """Start `vsnap serve`, SIGTERM it once ``phase`` started ("ready": once it serves); with
    ``tree_of``, once the engine tree of that control directory also runs. Its exit code, events
    and stderr."""
    process = subprocess.Popen([VSNAP, "serve", str(spec), "--port", "0"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})
    try:
        events = read_events(process.stdout, "ready") if phase == "ready" else []  # type: ignore[arg-type]
        while phase != "ready" and not (events and (events[-1]["phase"], events[-1]["state"]) == (phase, "start")):
            events += read_events(process.stdout, "phase")  # type: ignore[arg-type]
        deadline = time.monotonic() + 60
        while tree_of is not None and not engine_processes(tree_of) and time.monotonic() < deadline:
            time.sleep(0.01)
        process.send_signal(signal.SIGTERM)
        rest, stderr = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    return process.returncode, events + [json.loads(line) for line in rest.splitlines()], stderr


def assert_stopped_cleanly(result: tuple[int, list[dict[str, Any]], str], control_dir: Path, image: Path) -> None:
    returncode, events, stderr = result
    assert returncode == 0, stderr  # docs/fleet.md: a SIGTERM is a clean stop, exit 0, in every phase
    assert events[-1]["event"] == "stopped", events
    assert leftovers(control_dir) == []
    assert [i for i in ps_instances() if i["image"] == str(image)] == []  # no record left behind


@pytest.mark.parametrize("phase", ["verify image", "prepare host", "criu restore", "recover", "serve", "ready"])
def test_sigterm_in_any_phase_of_a_restore_leaves_nothing(captured: CapturedImage, phase: str) -> None:
    """Hostile pass 14: a SIGTERM while CRIU restored left the restored tree (and its CRIU) running,
    with no record for `vsnap ps` or `vsnap stop`. In "criu restore" the signal comes while CRIU
    runs, once it has restored the tree (the failpoint holds vsnap there, CRIU goes on)."""
    inside_criu = phase == "criu restore"
    result = sigterm_when(captured.spec, phase, env={"VSNAP_FAILPOINT": "stall inside criu restore"}
                          if inside_criu else None, tree_of=captured.control_dir if inside_criu else None)
    assert_stopped_cleanly(result, captured.control_dir, captured.image)
    assert not [e for e in result[1] if e["event"] == "fallback"]  # a stop, not a failure to fall back from


@pytest.mark.parametrize("phase", ["launch", "boot engine", "first completion", "ready"])
def test_sigterm_in_any_phase_of_a_cold_start_leaves_nothing(tmp_path: Path, phase: str) -> None:
    spec = write_spec(tmp_path, "serve-cold-stop")
    assert_stopped_cleanly(sigterm_when(spec, phase), tmp_path / "control" / "serve-cold-stop",
                           tmp_path / "images" / "serve-cold-stop")


def test_a_sigterm_that_came_before_serve_took_it_is_a_clean_stop(tmp_path: Path) -> None:
    """Hostile pass 14: the exit code after a SIGTERM was 143, 130 or 0 depending on when it came.
    One that arrives while SIGTERM is blocked (the mask a parent hands down) stands for one that
    arrives before vsnap serve installed its handler: it is taken as a stop, exit 0, nothing run."""
    spec = write_spec(tmp_path, "serve-early")
    process = subprocess.Popen([VSNAP, "serve", str(spec), "--port", "0"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True,
                               preexec_fn=lambda: signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM}))
    try:
        process.send_signal(signal.SIGTERM)
        events = read_events(process.stdout, "stopped")  # type: ignore[arg-type]  (a "ready" fails it)
        _, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0, stderr
    assert [e["event"] for e in events] == ["stopped"]
    assert leftovers(tmp_path / "control" / "serve-early") == []


def test_a_taken_port_is_refused_before_any_restore_or_cold_start(captured: CapturedImage) -> None:
    """Hostile pass 14: a taken port made the restore fail, then a full cold boot that could not
    bind it either."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        result = subprocess.run([VSNAP, "serve", str(captured.spec), "--port", str(port)], capture_output=True,
                                text=True, timeout=120)
    assert result.returncode == 3, result.stderr  # HostNotReady, as every refusal of the host
    assert f"cannot serve on 127.0.0.1:{port}: Address already in use" in result.stderr
    assert "choose another --port" in result.stderr
    assert [json.loads(line)["event"] for line in result.stdout.splitlines()] == ["start"]
    assert leftovers(captured.control_dir) == []


def test_a_ready_file_left_by_a_killed_serve_never_passes_the_next_probe(tmp_path: Path) -> None:
    """Hostile pass 14: a vsnap serve killed with SIGKILL left its ready file, and the readiness probe
    passed during the next boot, before its first completion. The next serve removes it before it
    starts anything (its first event); a file vsnap serve did not write is refused and kept."""
    spec = write_spec(tmp_path, "serve-stale")
    ready_file = tmp_path / "probe" / "ready"
    args = [VSNAP, "serve", str(spec), "--port", "0", "--ready-file", str(ready_file)]
    killed = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        url = read_events(killed.stdout, "ready")[-1]["url"]  # type: ignore[arg-type]
    finally:
        killed.kill()
        killed.wait()
    assert ready_file.read_text().splitlines()[0] == url  # left behind
    [record] = [i for i in ps_instances() if i["url"] == url]  # its tree, still serving, is stoppable
    assert subprocess.run([VSNAP, "stop", record["id"]], capture_output=True, timeout=120).returncode == 0

    process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = read_events(process.stdout, "start")  # type: ignore[arg-type]
        assert [e["event"] for e in first] == ["start"] and not ready_file.exists()
        assert read_events(process.stdout, "ready")[-1]["how"] == "cold"  # type: ignore[arg-type]
        assert ready_file.exists()
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0, stderr
    assert not ready_file.exists()

    ready_file.write_text("important\n")
    ready_file.chmod(0o600)  # root's, private: only its text tells it is not vsnap serve's
    refused = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 8, refused.stderr  # an unsafe control file
    assert f"error: {ready_file}: not a ready file vsnap serve wrote; left as it is" in refused.stderr
    assert "--ready-file" in refused.stderr and refused.stdout == ""
    assert ready_file.read_text() == "important\n"
    assert leftovers(tmp_path / "control" / "serve-stale") == []
