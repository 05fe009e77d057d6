"""A hostile user against the real thing (CRIU, the CPU engine): vsnap runs as root, so an image
someone else could have chosen, a path that leaves the image, a link at a lock, an ordinary
directory under --force, a write into a capturing tree's control directory and a stop during a
restore must each be refused or handled in one line, with nothing lost and nothing left running."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import VSNAP, engine_processes
from tests.integration.conftest import CapturedImage, run_vsnap, write_spec
from vsnap import capture_image, load_spec
from vsnap.protocol import control
from vsnap.protocol.errors import CheckpointError

pytestmark = pytest.mark.criu
NOBODY = 65534


def copy_image(captured: CapturedImage, tmp_path: Path) -> Path:
    parent = tmp_path / "copies"
    parent.mkdir(mode=0o700)
    image = parent / "img"
    shutil.copytree(captured.image, image, symlinks=True)
    return image


def test_force_never_deletes_an_ordinary_directory(tmp_path: Path) -> None:
    data = tmp_path / "images" / "precious"
    data.mkdir(parents=True, mode=0o700)
    (data / "thesis.txt").write_text("years of work")
    spec = write_spec(tmp_path, "precious")
    result = run_vsnap("capture", str(spec), "--force")
    assert result.returncode == 4
    assert "is not a vsnap image" in result.stderr and "Traceback" not in result.stderr
    assert (data / "thesis.txt").read_text() == "years of work"
    assert engine_processes(tmp_path / "control" / "precious") == []  # refused before the boot


def test_a_link_at_the_image_path_or_the_lock_is_refused_in_one_line(tmp_path: Path) -> None:
    spec = write_spec(tmp_path, "linked")
    images = tmp_path / "images"
    images.mkdir(mode=0o700)
    victim = tmp_path / "victim"
    victim.mkdir()
    (images / "linked").symlink_to(victim)
    result = run_vsnap("capture", str(spec), "--force")
    assert result.returncode == 4 and "is a symlink; vsnap never replaces or follows one" in result.stderr
    (images / "linked").unlink()
    (images / ".linked.lock").symlink_to(tmp_path / "lock-target")
    result = run_vsnap("capture", str(spec))
    assert result.returncode == 4 and "Traceback" not in result.stderr
    assert "is a symlink; vsnap never follows a link at its lock" in result.stderr
    assert not (tmp_path / "lock-target").exists()


def test_an_image_another_user_owns_is_refused_before_criu(captured: CapturedImage, tmp_path: Path) -> None:
    image = copy_image(captured, tmp_path)
    for path in [image, *image.rglob("*")]:
        os.lchown(path, NOBODY, NOBODY)
    instances = Path(f"{captured.control_dir}.instances")
    before = set(instances.iterdir())
    for command in (["restore", str(image), "--port", "0"], ["validate", str(image)]):
        result = run_vsnap(*command)
        assert result.returncode == 4, result.stderr
        assert "owned by uid 65534, not by root" in result.stderr + result.stdout
    assert engine_processes(captured.control_dir) == []
    assert set(instances.iterdir()) == before  # refused in verification: no instance, so no CRIU run


def test_a_manifest_path_that_leaves_the_image_is_refused(captured: CapturedImage, tmp_path: Path) -> None:
    """The reported attack: shm_files with ../../.. made root copy a file into a root-only directory."""
    image = copy_image(captured, tmp_path)
    manifest = json.loads((image / "manifest.json").read_text())
    target = tmp_path / "root-only"
    target.mkdir(mode=0o700)
    manifest["shm_files"] = [f"../../../../../..{target}/planted"]
    (image / "manifest.json").write_text(json.dumps(manifest))
    os.chmod(image / "manifest.json", 0o600)
    for command in (["restore", str(image), "--port", "0"], ["validate", str(image)]):
        result = run_vsnap(*command)
        assert result.returncode == 4, result.stderr
        assert "must be plain file names" in result.stderr + result.stdout
    assert list(target.iterdir()) == []
    manifest["shm_files"] = []
    manifest["files"]["../outside"] = {"size": 1, "digest": "0" * 64, "scheme": "sha256"}
    (image / "manifest.json").write_text(json.dumps(manifest))
    result = run_vsnap("restore", str(image), "--port", "0")
    assert result.returncode == 4 and "names a path outside the image" in result.stderr


def test_an_activation_written_before_the_dump_fails_the_capture(tmp_path: Path) -> None:
    spec = load_spec(write_spec(tmp_path, "forged"))
    instances = Path(f"{spec.control_dir}.instances")
    done = threading.Event()

    def forge() -> None:  # as soon as the tree is at its barrier, someone writes an activation
        while not done.is_set():
            for ready in instances.glob("capture-*/ready.json"):
                (ready.parent / "activation.json").write_text(
                    '{"host": "127.0.0.1", "port": 1, "protocol": %d, "vsnap": "0.2.0"}' % control.PROTOCOL_VERSION)
                os.chmod(ready.parent / "activation.json", 0o600)
                return
            time.sleep(0.001)

    forger = threading.Thread(target=forge)
    forger.start()
    try:
        with pytest.raises(CheckpointError, match="activation.json appeared in the capturing tree's control"):
            capture_image(spec)
    finally:
        done.set()
        forger.join()
    assert not spec.image_dir.exists()
    assert [p.name for p in spec.image_dir.parent.iterdir() if ".staging-" in p.name] == []
    assert engine_processes(spec.control_dir) == []


def test_stop_during_a_restore_wins_and_nothing_serves(captured: CapturedImage) -> None:
    restore = subprocess.Popen([VSNAP, "restore", str(captured.image), "--port", "0", "--detach"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "VSNAP_FAILPOINT": "stall recover"})
    try:
        deadline = time.monotonic() + 30
        while '"restoring"' not in (ps := run_vsnap("ps", "--json").stdout) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert '"restoring"' in ps
        stopped = run_vsnap("stop", str(captured.image))
        assert stopped.returncode == 0, stopped.stderr
        out, err = restore.communicate(timeout=60)
    finally:
        if restore.poll() is None:
            restore.kill()
    assert restore.returncode == 5 and "stopped by `vsnap stop` while restoring" in err
    assert engine_processes(captured.control_dir) == []
    listed = json.loads(run_vsnap("ps", "--json").stdout)["instances"]
    assert [r for r in listed if r["image"] == str(captured.image)] == []


def test_a_dead_instance_is_gone_and_its_shm_directory_removed(captured: CapturedImage) -> None:
    result = run_vsnap("restore", str(captured.image), "--port", "0", "--detach", "--json")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    shm = Path(f"/dev/shm/vsnap-{doc['instance']}")
    assert shm.is_dir()
    os.kill(doc["pid"], signal.SIGKILL)  # the tree dies behind vsnap's back
    deadline = time.monotonic() + 10
    while engine_processes(captured.control_dir) and time.monotonic() < deadline:
        time.sleep(0.05)
    first = run_vsnap("ps").stdout
    assert doc["instance"] in first and "gone" in first  # shown once as gone, then pruned
    assert doc["instance"] not in run_vsnap("ps").stdout
    assert not shm.exists()
    assert run_vsnap("stop", doc["instance"]).returncode != 0  # nothing to act on


def test_nothing_an_untrusted_image_names_is_read(tmp_path: Path) -> None:
    """The hostile pass: a FIFO as the manifest, or a manifest naming a FIFO as a dependency, hung
    restore and validate (root read what another user chose). Now the trust check comes first."""
    parent = tmp_path / "mallory"
    parent.mkdir(mode=0o755)
    image = parent / "img"
    image.mkdir()
    os.mkfifo(image / "manifest.json")
    for path in (parent, image, image / "manifest.json"):
        os.chown(path, NOBODY, NOBODY)
    for command in (["restore", str(image), "--port", "0"], ["validate", str(image)]):
        result = run_vsnap(*command, timeout=60)
        assert result.returncode == 4, result.stderr
        assert "owned by uid 65534, not by root" in result.stderr + result.stdout
    (image / "manifest.json").unlink()
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    manifest = {"format_version": 2, "dependencies": [{"path": str(fifo), "size": 0}], "files": {}}
    (image / "manifest.json").write_text(json.dumps(manifest))
    os.chown(image / "manifest.json", NOBODY, NOBODY)
    result = run_vsnap("validate", str(image), "--json", timeout=60)
    assert result.returncode == 4
    checks = {c["name"]: c["ok"] for c in json.loads(result.stdout)["checks"]}
    assert checks == {"trust": False}  # neither the manifest nor what it names was looked at


def test_gpu_for_an_image_without_cuda_state_is_refused(captured: CapturedImage) -> None:
    result = run_vsnap("restore", str(captured.image), "--port", "0", "--gpu", "0")
    assert result.returncode == 11
    assert "holds no CUDA state" in result.stderr
    assert engine_processes(captured.control_dir) == []


def test_an_image_of_another_engine_protocol_is_refused_before_criu(captured: CapturedImage, tmp_path: Path) -> None:
    image = copy_image(captured, tmp_path)
    manifest = json.loads((image / "manifest.json").read_text())
    manifest["protocol_version"], manifest["vsnap_version"] = 1, "0.1.0"
    (image / "manifest.json").write_text(json.dumps(manifest))
    result = run_vsnap("restore", str(image), "--port", "0")
    assert result.returncode == 4
    assert "captured by vsnap 0.1.0 (engine protocol 1); this vsnap speaks vsnap" in result.stderr
    assert "criu restore" not in result.stderr  # refused in the verify phase, before CRIU
    assert engine_processes(captured.control_dir) == []


def test_a_restore_holds_the_image_until_its_weights_are_read(captured: CapturedImage) -> None:
    """A capture's publish (the exclusive readers' lock) must wait while a restore is recovering."""
    from vsnap.image.store import image_read_lock
    from vsnap.protocol.errors import ImageBusy

    restore = subprocess.Popen([VSNAP, "restore", str(captured.image), "--port", "0", "--detach", "--json"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "VSNAP_FAILPOINT": "stall recover"})
    try:
        deadline = time.monotonic() + 30
        while '"restoring"' not in run_vsnap("ps", "--json").stdout and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(ImageBusy, match="restores are still reading"):
            with image_read_lock(captured.image, exclusive=True, timeout_s=0.5):
                pass
        out, err = restore.communicate(timeout=60)
        assert restore.returncode == 0, err
        with image_read_lock(captured.image, exclusive=True, timeout_s=5):  # released once it serves
            pass
    finally:
        if restore.poll() is None:
            restore.kill()
    assert run_vsnap("stop", json.loads(out)["instance"]).returncode == 0


def test_modules_in_the_callers_working_directory_never_run(captured: CapturedImage, tmp_path: Path) -> None:
    """The second hostile pass: the tree inherited the caller's working directory, and `python -m`
    put it first on sys.path: a json.py (or httptools.py, imported at serve) planted there ran as root."""
    planted = tmp_path / "eve"
    planted.mkdir()
    os.chmod(planted, 0o777)
    marker = tmp_path / "pwned"
    for module in ("json", "httptools", "uvicorn", "vsnap"):
        (planted / f"{module}.py").write_text(f"open({str(marker)!r}, 'a').write('{module}\\n')\nraise ImportError\n")
    spec = write_spec(tmp_path, "cwd")
    result = subprocess.run([VSNAP, "capture", str(spec)], cwd=planted, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    restored = subprocess.run([VSNAP, "restore", str(tmp_path / "images" / "cwd"), "--port", "0", "--detach", "--json"],
                              cwd=planted, capture_output=True, text=True, timeout=300)
    assert restored.returncode == 0, restored.stderr
    assert run_vsnap("stop", json.loads(restored.stdout)["instance"]).returncode == 0
    assert not marker.exists()


def test_bench_writes_no_record_through_a_planted_link(tmp_path: Path) -> None:
    """The second hostile pass: `vsnap bench --out` wrote through links planted at the record names."""
    out = tmp_path / "out"
    out.mkdir(mode=0o700)
    victim = tmp_path / "victim"
    victim.write_text("root's file")
    spec = write_spec(tmp_path, "benchlink")
    from datetime import date

    (out / f"bench-benchlink-{date.today().isoformat()}.md").symlink_to(victim)
    result = run_vsnap("bench", str(spec), "--runs", "1", "--cold-runs", "1", "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert victim.read_text() == "root's file"
    assert not (out / f"bench-benchlink-{date.today().isoformat()}.md").is_symlink()
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    result = run_vsnap("bench", str(spec), "--runs", "1", "--cold-runs", "1", "--out", str(shared / "o"))
    assert result.returncode == 4 and "group or others can write it" in result.stderr
    assert "✗ preflight" in result.stderr and "✓ capture" not in result.stderr  # refused before measuring


def test_sighup_tears_a_capture_down_like_ctrl_c(tmp_path: Path) -> None:
    """The second hostile pass: SIGHUP (a closed terminal) ended vsnap at once and left the tree,
    the staging directory (process memory), the /dev/shm directory and the record behind."""
    spec = write_spec(tmp_path, "hup")
    control_dir = tmp_path / "control" / "hup"
    capture = subprocess.Popen([VSNAP, "capture", str(spec)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not engine_processes(control_dir) and time.monotonic() < deadline:
        time.sleep(0.05)
    capture.send_signal(signal.SIGHUP)
    _, err = capture.communicate(timeout=60)
    assert capture.returncode == 130, err
    assert engine_processes(control_dir, launching=True) == []
    images = tmp_path / "images"
    assert [p.name for p in images.iterdir() if ".staging-" in p.name] == []
    instance = [p.name for p in Path(f"{control_dir}.instances").iterdir()]
    assert instance and not any(Path(f"/dev/shm/vsnap-{name}").exists() for name in instance)
    assert not any(Path(f"/run/vsnap/captures/{name}.json").exists() for name in instance)


def test_validate_spec_checks_the_control_directory_parents(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    spec = tmp_path / "s.yaml"
    spec.write_text(f"name: s\nengine: cpu\nimage: {tmp_path}/images/s\nsnapshot:\n  control_dir: {shared}/ctl\n")
    result = run_vsnap("validate", str(spec), "--json")
    checks = {c["name"]: c for c in json.loads(result.stdout)["checks"]}
    assert result.returncode == 4 and not checks["control directory"]["ok"]
    assert "group or others can write it" in checks["control directory"]["detail"]
    assert not (shared / "ctl").exists()  # validate creates nothing
