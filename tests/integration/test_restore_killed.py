"""A restore SIGKILLed while CRIU runs (issue 26, item 5): its tree is tracked and stoppable until it
is gone, and its CRIU pidfile does not outlive the next prune.

Hostile pass 12 found the tree running for 15-20 s (until it noticed its owner's silence) while
`vsnap ps` called the instance gone and `vsnap stop` found nothing, and RUNTIME_DIR/pids/<id>.pid
left for ever. Here the real `vsnap restore` of the CPU engine is killed from outside once its CRIU
has forked the tree's root (no failpoint: what a user's SIGKILL or the OOM killer does).

Then a restore interrupted (Ctrl-C) instead (hostile pass 14): it ends promptly, with nothing left
running and no record, wherever the SIGINT lands.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import VSNAP, engine_processes
from tests.integration.conftest import CapturedImage, run_vsnap
from vsnap.host.paths import RUNTIME_DIR
from vsnap.protocol.control import OWNER_TIMEOUT_S

pytestmark = pytest.mark.criu


def _criu_child(vsnap: psutil.Process) -> psutil.Process | None:
    try:
        return next((c for c in vsnap.children() if c.name() == "criu"), None)
    except psutil.Error:
        return None


def kill_restore_inside_criu(image: Path) -> None:
    """Start `vsnap restore`, SIGKILL it once its `criu restore` has forked the tree's root."""
    restore = subprocess.Popen([VSNAP, "restore", str(image), "--port", "0"], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    vsnap = psutil.Process(restore.pid)
    deadline = time.monotonic() + 120
    while True:
        assert restore.poll() is None, "the restore ended before it could be killed inside CRIU"
        assert time.monotonic() < deadline, "no criu restore started"
        criu = _criu_child(vsnap)
        try:
            if criu is not None and criu.children():
                break
        except psutil.Error:
            pass
        time.sleep(0.002)
    restore.send_signal(signal.SIGKILL)
    restore.wait()


def ps() -> tuple[list[dict], list[dict]]:
    result = run_vsnap("ps", "--json")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    return doc["instances"], doc["gone"]


def ours(records: list[dict], image: Path) -> list[dict]:
    return [r for r in records if r["image"] == str(image)]


def test_a_restore_killed_in_criu_is_shown_and_stopped(captured: CapturedImage) -> None:
    kill_restore_inside_criu(captured.image)
    running, gone = ps()
    assert ours(gone, captured.image) == []
    [record] = ours(running, captured.image)
    assert record["state"] == "restoring" and record["tree"] is not None
    # CRIU may still be filling the tree's memory: its command line reads empty until then
    appeared = time.monotonic() + 5
    while not engine_processes(captured.control_dir) and time.monotonic() < appeared:
        time.sleep(0.05)
    assert engine_processes(captured.control_dir), "the tree CRIU restored should still run"
    started = time.monotonic()
    stopped = run_vsnap("stop", record["id"])
    assert stopped.returncode == 0, stopped.stderr
    while engine_processes(captured.control_dir) and time.monotonic() - started < 5:  # well before the owner timeout
        time.sleep(0.1)
    assert engine_processes(captured.control_dir) == []
    assert ours(ps()[0], captured.image) == []


def test_ps_tracks_it_until_it_is_gone_and_the_prune_removes_its_pidfile(captured: CapturedImage) -> None:
    kill_restore_inside_criu(captured.image)
    instance_id = ""
    deadline = time.monotonic() + OWNER_TIMEOUT_S + 30
    while True:  # the tree ends by itself once its owner is silent; until then ps shows it
        alive_before = bool(engine_processes(captured.control_dir))
        shown = ours(ps()[0], captured.image)
        alive_after = bool(engine_processes(captured.control_dir))
        if not alive_before and not shown:
            break
        assert not (alive_before and alive_after) or shown, "a live tree of a killed restore is missing from ps"
        assert time.monotonic() < deadline, "the tree outlived its owner's timeout"
        instance_id = instance_id or (shown[0]["id"] if shown else "")
        time.sleep(0.5)
    assert instance_id, "ps never showed the instance"
    again = run_vsnap("restore", str(captured.image), "--port", "0", "--detach", "--json")  # prunes first
    assert again.returncode == 0, again.stderr
    assert run_vsnap("stop", str(captured.image)).returncode == 0
    assert not (RUNTIME_DIR / "pids" / f"{instance_id}.pid").exists()


def test_a_restore_killed_as_criu_starts_is_stopped_at_once(captured: CapturedImage) -> None:
    """The failpoint kills vsnap right after it recorded CRIU, before CRIU forked anything: `vsnap stop`
    at once waits for CRIU's tree to appear (host.instances.ORPHAN_FORK_WAIT_S) and ends it."""
    result = subprocess.run([VSNAP, "restore", str(captured.image), "--port", "0"], capture_output=True, text=True,
                            timeout=120, env={**os.environ, "VSNAP_FAILPOINT": "inside criu restore"})
    assert result.returncode == -signal.SIGKILL
    running, _ = ps()
    [record] = ours(running, captured.image)
    assert record["criu"] is not None or record["tree"] is not None
    stopped = run_vsnap("stop", record["id"])
    assert stopped.returncode == 0, stopped.stderr
    deadline = time.monotonic() + 5  # well before the tree's own owner timeout (OWNER_TIMEOUT_S)
    while (engine_processes(captured.control_dir) or ours(ps()[0], captured.image)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert engine_processes(captured.control_dir) == [] and ours(ps()[0], captured.image) == []


def interrupt_restore(image: Path, *, when: str, env: dict[str, str] | None = None,
                      blocked: bool = False) -> subprocess.CompletedProcess[str]:
    """Start `vsnap restore IMAGE`, SIGINT it (Ctrl-C) once ``when`` holds (a callable of its pid,
    or "at once"), and wait for it to end. ``blocked``: SIGINT blocked in the mask it inherits."""
    restore = subprocess.Popen([VSNAP, "restore", str(image), "--port", "0"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})},
                               preexec_fn=(lambda: signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT}))
                               if blocked else None)
    try:
        deadline = time.monotonic() + 120
        while when != "at once" and not when(restore.pid):  # type: ignore[operator]
            assert restore.poll() is None, "the restore ended before it could be interrupted"
            assert time.monotonic() < deadline, "the moment to interrupt never came"
            time.sleep(0.001)
        restore.send_signal(signal.SIGINT)
        stdout, stderr = restore.communicate(timeout=120)  # a deadline for the test, not a measure
    finally:
        if restore.poll() is None:
            restore.kill()
            restore.wait()
    return subprocess.CompletedProcess(restore.args, restore.returncode, stdout, stderr)


def test_ctrl_c_while_criu_restores_leaves_nothing_running(captured: CapturedImage) -> None:
    """Hostile pass 14: Ctrl-C once CRIU had restored the tree (CRIU still running, or just ended)
    left that tree running with no record: `vsnap ps` and `vsnap stop` could not see it. The
    failpoint holds vsnap inside the CRIU phase while CRIU goes on; the Ctrl-C comes once the tree runs."""
    result = interrupt_restore(captured.image, when=lambda _: bool(engine_processes(captured.control_dir)),
                               env={"VSNAP_FAILPOINT": "stall inside criu restore"})
    assert result.returncode == 130, result.stderr
    assert engine_processes(captured.control_dir, launching=True) == []
    assert not [p for p in psutil.process_iter(["name", "cmdline"])
                if p.info["name"] == "criu" and str(captured.control_dir) in " ".join(p.info["cmdline"] or [])]
    assert ours(ps()[0], captured.image) == []


def test_a_ctrl_c_held_back_at_the_start_ends_the_restore(captured: CapturedImage) -> None:
    """Hostile pass 14: `vsnap restore` ran on after an early Ctrl-C. A SIGINT that arrives while the
    signal is blocked (the mask a parent hands down) is taken once the command can act on it, not
    never; nothing is started."""
    result = interrupt_restore(captured.image, when="at once", blocked=True)
    assert result.returncode == 130, result.stderr
    assert "interrupted" in result.stderr and result.stdout == ""
    assert engine_processes(captured.control_dir, launching=True) == []
    assert ours(ps()[0], captured.image) == []


def _holds_open(pid: int, path: Path) -> bool:
    try:
        return any(os.readlink(f"/proc/{pid}/fd/{fd}") == str(path) for fd in os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return False


def test_ctrl_c_while_the_image_is_hashed_does_not_wait_for_the_hash(captured: CapturedImage,
                                                                     tmp_path: Path) -> None:
    """Hostile pass 14: an early Ctrl-C waited until every image file was hashed (the verify phase's
    threads, then the interpreter's exit, joined them: no deadline; minutes for a large image).
    Here a 3 GiB file (a hole: no disk) is added to a copy of the image; the Ctrl-C comes once it is
    being hashed, and the command ends before that hash does: the files it had to hash are never
    recorded as verified (a hash that completed would be)."""
    from vsnap.host import verified
    from vsnap.image import store

    image = tmp_path / "images" / "big"
    shutil.copytree(captured.image, image, symlinks=True)
    big = image / "big.bin"
    size = 48 * store.PIECE
    with open(big, "wb") as f:
        f.truncate(size)
    os.chmod(big, 0o644)
    piece = hashlib.sha256(bytes(store.PIECE)).hexdigest()
    manifest = json.loads((image / "manifest.json").read_text())
    manifest["files"]["big.bin"] = {"size": size, "digest": hashlib.sha256((piece * 48).encode()).hexdigest(),
                                    "scheme": store.digest_scheme(size)}
    (image / "manifest.json").write_text(json.dumps(manifest))
    result = interrupt_restore(image, when=lambda pid: _holds_open(pid, big))
    assert result.returncode == 130, result.stderr
    assert "big.bin" not in verified.load(image)
    assert engine_processes(captured.control_dir, launching=True) == []
