"""Faults, with the real thing: a SIGKILLed vsnap, CRIU failing mid-dump and mid-restore, a full disk.

Afterwards there must be no image under the final name unless it is complete, an older good image
must be untouched, no process of the tree may stay alive, and the same command must work again.
SIGKILL comes from the VSNAP_FAILPOINT hook (vsnap kills itself at the start of a phase, or at its
end with "after PHASE"); CRIU failures come from a real CRIU whose action script fails.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import VSNAP, engine_processes
from tests.integration.conftest import CapturedImage, run_vsnap, write_spec
from vsnap.host.criu.runner import find_criu
from vsnap.protocol.control import OWNER_TIMEOUT_S

pytestmark = pytest.mark.criu


def run_with(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([VSNAP, *args], capture_output=True, text=True, timeout=300, env={**os.environ, **env})


def wait_no_engine(control_dir: Path, timeout_s: float = OWNER_TIMEOUT_S + 30) -> None:
    """The tree of a SIGKILLed owner notices the silence and shuts itself down."""
    deadline = time.monotonic() + timeout_s
    while engine_processes(control_dir, launching=True) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert engine_processes(control_dir, launching=True) == []


def staging_dirs(image: Path) -> list[str]:
    return [p.name for p in image.parent.iterdir() if ".staging-" in p.name] if image.parent.exists() else []


@pytest.mark.parametrize("phase", ["boot engine", "criu dump"])
def test_capture_killed_leaves_nothing_and_reruns(tmp_path: Path, phase: str) -> None:
    spec = write_spec(tmp_path, "killed")
    image, control_dir = tmp_path / "images" / "killed", tmp_path / "control" / "killed"
    result = run_with({"VSNAP_FAILPOINT": phase}, "capture", str(spec))
    assert result.returncode == -signal.SIGKILL
    assert not image.exists()
    wait_no_engine(control_dir)
    again = run_vsnap("capture", str(spec), "--json")
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["image"] == str(image)
    assert staging_dirs(image) == []  # the killed run's staging directory was cleared


def test_capture_killed_before_publish_keeps_the_old_image(tmp_path: Path) -> None:
    spec = write_spec(tmp_path, "keep")
    image = tmp_path / "images" / "keep"
    assert run_vsnap("capture", str(spec)).returncode == 0
    old_manifest = (image / "manifest.json").read_bytes()
    result = run_with({"VSNAP_FAILPOINT": "after criu dump"}, "capture", str(spec), "--force")
    assert result.returncode == -signal.SIGKILL
    assert (image / "manifest.json").read_bytes() == old_manifest
    assert run_vsnap("validate", str(image)).returncode == 0  # every file still matches
    assert engine_processes(tmp_path / "control" / "keep") == []  # CRIU ended the tree with the dump
    # the killed capture's staging directory (process memory) is removed by the next vsnap run
    # that looks (any capture or restore on this host, perhaps a concurrent one)
    assert len(staging_dirs(image)) <= 1
    again = run_vsnap("capture", str(spec), "--force")
    assert again.returncode == 0, again.stderr
    assert (image / "manifest.json").read_bytes() != old_manifest
    assert staging_dirs(image) == []


@pytest.mark.parametrize("phase", ["criu restore", "recover", "serve"])
def test_restore_killed_leaves_nothing_and_reruns(captured: CapturedImage, phase: str) -> None:
    result = run_with({"VSNAP_FAILPOINT": phase}, "restore", str(captured.image), "--port", "0")
    assert result.returncode == -signal.SIGKILL
    wait_no_engine(captured.control_dir)
    again = run_vsnap("restore", str(captured.image), "--port", "0", "--detach", "--json")
    assert again.returncode == 0, again.stderr
    assert run_vsnap("stop", str(captured.image)).returncode == 0
    assert engine_processes(captured.control_dir) == []


def test_lazy_restore_killed_leaves_no_page_server(captured: CapturedImage) -> None:
    """SIGKILL during recover while `criu lazy-pages` may still be sending pages: the tree stops
    (its owner is silent), then the page server ends with it."""
    result = run_with({"VSNAP_FAILPOINT": "recover"}, "restore", str(captured.image), "--port", "0", "--lazy-pages")
    assert result.returncode == -signal.SIGKILL
    # First the page server: until it has sent the tree's stack pages, /proc/PID/cmdline of the
    # tree's processes reads empty, and engine_processes() would miss them.
    deadline = time.monotonic() + OWNER_TIMEOUT_S + 30
    while subprocess.run(["pgrep", "-f", f"lazy-pages .*--images-dir {captured.image}"]).returncode == 0:
        assert time.monotonic() < deadline, "criu lazy-pages outlived the tree"
        time.sleep(0.1)
    wait_no_engine(captured.control_dir)


def test_foreground_restore_killed_while_serving_stops_the_server(captured: CapturedImage) -> None:
    process = subprocess.Popen([VSNAP, "restore", str(captured.image), "--port", "0", "--json"],
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert process.stdout is not None
    while not process.stdout.readline().startswith("}"):
        pass
    assert len(engine_processes(captured.control_dir)) == 1
    process.kill()
    process.wait()
    wait_no_engine(captured.control_dir)


def test_detached_server_outlives_its_restore(captured: CapturedImage) -> None:
    result = run_vsnap("restore", str(captured.image), "--port", "0", "--detach", "--json")
    assert result.returncode == 0
    pid = json.loads(result.stdout)["pid"]
    time.sleep(OWNER_TIMEOUT_S + 3)
    assert engine_processes(captured.control_dir) == [pid]
    assert run_vsnap("stop", str(captured.image)).returncode == 0


@pytest.fixture
def failing_criu(tmp_path: Path) -> Path:
    """A real CRIU whose action script fails at the stage named by FAIL_AT."""
    script = tmp_path / "fail-at.sh"
    script.write_text('#!/bin/sh\n[ "$CRTOOLS_SCRIPT_ACTION" = "$FAIL_AT" ] && exit 1\nexit 0\n')
    wrapper = tmp_path / "criu"
    wrapper.write_text(f'#!/bin/sh\nexec {find_criu()} "$@" --action-script {script}\n')
    for path in (script, wrapper):
        path.chmod(0o755)
    return wrapper


def test_criu_failing_mid_dump(tmp_path: Path, failing_criu: Path) -> None:
    spec = write_spec(tmp_path, "dumpfail")
    image, control_dir = tmp_path / "images" / "dumpfail", tmp_path / "control" / "dumpfail"
    result = run_with({"VSNAP_CRIU": str(failing_criu), "FAIL_AT": "post-dump"}, "capture", str(spec))
    assert result.returncode == 5, result.stderr
    assert "criu dump failed" in result.stderr and "log:" in result.stderr
    assert not image.exists() and staging_dirs(image) == []
    assert engine_processes(control_dir) == []
    assert run_vsnap("capture", str(spec)).returncode == 0


def test_criu_failing_mid_restore(captured: CapturedImage, failing_criu: Path) -> None:
    result = run_with({"VSNAP_CRIU": str(failing_criu), "FAIL_AT": "post-restore"},
                      "restore", str(captured.image), "--port", "0")
    assert result.returncode == 5, result.stderr
    assert "criu restore failed" in result.stderr
    assert engine_processes(captured.control_dir) == []
    again = run_vsnap("restore", str(captured.image), "--port", "0", "--detach")
    assert again.returncode == 0, again.stderr
    assert run_vsnap("stop", str(captured.image)).returncode == 0


def test_disk_full_while_writing_the_image(tmp_path: Path) -> None:
    """The check once the tree booted: 200 MB pass the preflight's lower bound (ops/resources,
    0.13 GB for the built-in engine; tests/integration/test_resources_refused.py refuses there) and
    are less than the booted tree's memory (about 0.33 GB)."""
    small = tmp_path / "small"
    small.mkdir(mode=0o700)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=200m,mode=0700", "tmpfs", str(small)], check=True)
    try:
        spec = write_spec(tmp_path, "full")
        text = spec.read_text().replace(f"image: {tmp_path}/images/full", f"image: {small}/full")
        spec.write_text(text)
        result = run_vsnap("capture", str(spec))
        assert result.returncode == 5, result.stderr
        assert f"not enough space for the image on the disk holding {small}" in result.stderr
        assert list(small.iterdir()) in ([], [small / ".full.lock"])
        assert engine_processes(tmp_path / "control" / "full") == []
    finally:
        subprocess.run(["umount", "-l", str(small)])


def test_two_captures_into_one_image_path(tmp_path: Path) -> None:
    spec = write_spec(tmp_path, "twice")
    first = subprocess.Popen([VSNAP, "capture", str(spec)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not engine_processes(tmp_path / "control" / "twice") and time.monotonic() < deadline:
        time.sleep(0.1)  # the engine starts only once the first capture holds the image lock
    second = run_vsnap("capture", str(spec))
    assert first.wait(timeout=300) == 0
    assert second.returncode == 4
    assert "another vsnap capture is writing" in second.stderr


def test_an_interrupt_while_the_tree_starts_leaves_no_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C or SIGHUP can arrive after unshare started the namespace but before launch_tree
    returned the tree to its caller (who would end it): launch_tree ends it itself. Seen in CI
    under load: a SIGHUP'd capture left its engine running."""
    from vsnap.host import proctree as _proctree

    control_dir, instance_dir, shm_dir = tmp_path / "ctl", tmp_path / "ctl.instances" / "i", tmp_path / "shm"
    for directory in (control_dir, instance_dir, shm_dir):
        directory.mkdir(parents=True, mode=0o700)
    real_identify = _proctree.identify
    interrupted: list[int] = []

    def identify(pid: int):  # type: ignore[no-untyped-def]
        if interrupted:  # once: the cleanup identifies what it ends
            return real_identify(pid)
        deadline = time.monotonic() + 30  # until the engine itself runs in the new namespace
        while not engine_processes(control_dir) and time.monotonic() < deadline:
            time.sleep(0.01)
        interrupted.append(pid)
        raise KeyboardInterrupt

    monkeypatch.setattr(_proctree, "identify", identify)
    with pytest.raises(KeyboardInterrupt):
        _proctree.launch_tree(control_dir, instance_dir, shm_dir, dict(os.environ), adopt=lambda tree: None)
    assert interrupted and engine_processes(control_dir, launching=True) == []
    monkeypatch.setattr(_proctree, "identify", real_identify)

    # CI #12: SIGHUP right after launch_tree returned, before the capture registered the tree's
    # teardown, left the tree running. The caller now adopts it inside launch_tree: an interrupt
    # there still ends it.
    def interrupted_adoption(tree: _proctree.LaunchedTree) -> None:
        deadline = time.monotonic() + 30
        while not engine_processes(control_dir) and time.monotonic() < deadline:
            time.sleep(0.01)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _proctree.launch_tree(control_dir, instance_dir, shm_dir, dict(os.environ), adopt=interrupted_adoption)
    assert engine_processes(control_dir, launching=True) == []
