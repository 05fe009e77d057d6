"""Standbys, for real (CPU engine, real CRIU): `vsnap restore --standby` brings the tree back and
leaves it waiting without a port; `vsnap activate` serves it with the oracle; stop, owner death and
a recaptured image are handled like any instance's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import VSNAP, engine_processes
from tests.integration.conftest import run_vsnap, write_spec
from tests.integration.test_cpu_roundtrip import assert_serves_oracle
from vsnap import read_manifest
from vsnap.host.instances import running_instances
from vsnap.protocol import control

pytestmark = pytest.mark.criu

# The spec's timeout_s: a standby must outwait it (the activation wait of a restored tree is bounded
# by it unless it stands by)
TIMEOUT_S = 12


def records(image: Path) -> list:
    return [r for r in running_instances() if r.image == str(image)]


def json_of(result: subprocess.CompletedProcess[str]) -> dict:
    assert result.stdout, result.stderr
    return dict(json.loads(result.stdout))


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("standby")
    spec = write_spec(base, "cpu-standby")
    spec.write_text(spec.read_text().replace("timeout_s: 120", f"timeout_s: {TIMEOUT_S}"))
    result = run_vsnap("capture", str(spec), "--json")
    assert result.returncode == 0, result.stderr
    path = Path(json_of(result)["image"])
    yield path
    for record in records(path):
        run_vsnap("stop", record.id)


def test_a_standby_waits_past_its_timeout_without_a_port_then_activates_and_serves(image: Path) -> None:
    control_dir = Path(read_manifest(image).control_dir)
    waiting = json_of(run_vsnap("restore", str(image), "--standby", "--detach", "--json"))
    assert waiting["state"] == "standby" and waiting["memory_bytes"] > 10 << 20
    assert set(waiting["timings"]) == {"verify image", "prepare host", "criu restore"}
    instance = waiting["instance"]
    try:
        [record] = records(image)
        assert (record.id, record.state, record.port, record.url) == (instance, "standby", 0, "")
        assert engine_processes(control_dir) == [waiting["pid"]]
        ps = json_of(run_vsnap("ps", "--json"))
        assert [i["state"] for i in ps["instances"] if i["id"] == instance] == ["standby"]
        time.sleep(TIMEOUT_S + 1)  # longer than the tree's activation wait would otherwise allow
        assert engine_processes(control_dir) == [waiting["pid"]]
        result = run_vsnap("activate", instance, "--port", "0", "--json")
        assert result.returncode == 0, result.stderr
        served = json_of(result)
        assert served["instance"] == instance and served["pid"] == waiting["pid"]
        assert set(served["timings"]) == {"verify image", "recover", "serve"}
        manifest = read_manifest(image)
        assert_serves_oracle(served["url"], manifest.oracle, manifest.launch.oracle_top_k)
        [record] = records(image)
        assert (record.state, record.url, record.activator) == ("serving", served["url"], None)
        again = run_vsnap("activate", instance, "--port", "0", "--json")
        assert again.returncode == 10 and "is serving, not a standby" in json_of(again)["message"]
    finally:
        run_vsnap("stop", instance)
    assert engine_processes(control_dir) == [] and records(image) == []
    assert not Path(f"/dev/shm/vsnap-{instance}").exists()


def test_stop_ends_a_standby_and_an_unknown_one_is_refused(image: Path) -> None:
    control_dir = Path(read_manifest(image).control_dir)
    waiting = json_of(run_vsnap("restore", str(image), "--standby", "--detach", "--json"))
    stopped = json_of(run_vsnap("stop", waiting["instance"], "--json"))
    assert stopped["stopped"] == [{"id": waiting["instance"], "pid": waiting["pid"]}]
    assert engine_processes(control_dir) == [] and records(image) == []
    unknown = run_vsnap("activate", waiting["instance"], "--json")
    assert unknown.returncode == 9, unknown.stdout  # nothing runs at all now


def test_a_standby_whose_owner_dies_goes_away(image: Path) -> None:
    """A foreground standby (no --detach) is owned by its vsnap process, like a foreground restore."""
    control_dir = Path(read_manifest(image).control_dir)
    owner = subprocess.Popen([VSNAP, "restore", str(image), "--standby"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not [r for r in records(image) if r.state == "standby"]:
            assert owner.poll() is None and time.monotonic() < deadline, owner.communicate()
            time.sleep(0.2)
        [record] = records(image)
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait()
        deadline = time.monotonic() + control.OWNER_TIMEOUT_S + 15
        # the record goes once the tree's PID 1 is gone, a moment after its command line (which
        # engine_processes reads) emptied on its way out: CI #13 looked in between
        while (engine_processes(control_dir) or records(image)) and time.monotonic() < deadline:
            time.sleep(0.25)
        assert engine_processes(control_dir) == []
        assert records(image) == []
    finally:
        if owner.poll() is None:
            owner.kill()


def test_a_standby_refuses_to_activate_from_an_image_captured_again(image: Path, tmp_path: Path) -> None:
    manifest = read_manifest(image)
    waiting = json_of(run_vsnap("restore", str(image), "--standby", "--detach", "--json"))
    try:
        spec = tmp_path / "again.yaml"
        spec.write_text(f"name: cpu-standby\nengine: cpu\nimage: {image}\nsnapshot:\n"
                        f"  control_dir: {manifest.control_dir}\n  timeout_s: {TIMEOUT_S}\n")
        result = run_vsnap("capture", str(spec), "--force", "--json")
        assert result.returncode == 0, result.stderr
        refused = run_vsnap("activate", waiting["instance"], "--port", "0", "--json")
        assert refused.returncode == 4
        assert "was captured again after standby" in json_of(refused)["message"]
        assert [r.state for r in records(image)] == ["standby"]  # refused before anything ran: still waiting
    finally:
        run_vsnap("stop", waiting["instance"])
    assert engine_processes(Path(manifest.control_dir)) == []


def test_two_activations_of_one_standby_one_serves_the_other_is_refused(image: Path) -> None:
    """The loser must not touch the tree the winner brings up (its failure would end it)."""
    manifest = read_manifest(image)
    waiting = json_of(run_vsnap("restore", str(image), "--standby", "--detach", "--json"))
    try:
        racers = [subprocess.Popen([VSNAP, "activate", waiting["instance"], "--port", "0", "--json"],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
        results = [(r.wait(timeout=300), r.communicate()[0]) for r in racers]
        assert sorted(code for code, _ in results) == [0, 10], results
        served = json.loads(next(out for code, out in results if code == 0))
        refused = json.loads(next(out for code, out in results if code == 10))
        assert "not a standby" in refused["message"]
        assert_serves_oracle(served["url"], manifest.oracle, manifest.launch.oracle_top_k)
        assert [r.state for r in records(image)] == ["serving"]
    finally:
        run_vsnap("stop", waiting["instance"])
    assert engine_processes(Path(manifest.control_dir)) == []


def test_an_activation_interrupted_midway_ends_the_standby_and_removes_its_shm(image: Path) -> None:
    """A failed activation ends the standby (its state may be half restored) and removes what the
    tree held: its record and its /dev/shm directory, which is never removed while the tree has it
    bound, so the tree must go first."""
    manifest = read_manifest(image)
    waiting = json_of(run_vsnap("restore", str(image), "--standby", "--detach", "--json"))
    shm = Path("/dev/shm") / f"vsnap-{waiting['instance']}"
    activation = None
    try:
        assert shm.is_dir()
        activation = subprocess.Popen([VSNAP, "activate", waiting["instance"], "--port", "0"],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      env={**os.environ, "VSNAP_FAILPOINT": "stall recover"})
        deadline = time.monotonic() + 60
        while [r.state for r in records(image)] != ["activating"]:
            assert activation.poll() is None and time.monotonic() < deadline, activation.stderr
            time.sleep(0.01)
        time.sleep(0.5)  # inside the recover phase's 3 s stall
        activation.send_signal(signal.SIGINT)
        _, stderr = activation.communicate(timeout=60)
        assert activation.returncode == 130, stderr
        assert "Traceback" not in stderr
        assert records(image) == []
        assert engine_processes(Path(manifest.control_dir)) == []
        assert not shm.exists()
    finally:
        if activation is not None and activation.poll() is None:
            activation.kill()
        run_vsnap("stop", waiting["instance"])


@pytest.mark.parametrize("failpoint", ["recover", "after recover", "serve"])
def test_an_activator_killed_midway_ends_the_tree_within_seconds(image: Path, failpoint: str) -> None:
    """Issue 26, item 5: a `vsnap activate` SIGKILLed after it began bringing a detached standby up
    (no owner watches it) must not leave the tree holding what it restored (on a GPU: its memory).
    The tree watches the activator's heartbeat and ends itself; `vsnap ps` then prunes the record
    and the /dev/shm directory. Without it the tree waited for its activation without a timeout
    ("recover") or for its socket until timeout_s ("after recover", "serve")."""
    control_dir = Path(read_manifest(image).control_dir)
    waiting = json_of(run_vsnap("restore", str(image), "--standby", "--detach", "--json"))
    instance = waiting["instance"]
    try:
        killed = subprocess.run([VSNAP, "activate", instance, "--port", "0"], capture_output=True, text=True,
                                timeout=120, env={**os.environ, "VSNAP_FAILPOINT": failpoint})
        assert killed.returncode == -signal.SIGKILL, killed.stderr
        deadline = time.monotonic() + control.ACTIVATOR_TIMEOUT_S + 10
        while (engine_processes(control_dir) or records(image)) and time.monotonic() < deadline:
            time.sleep(0.25)
        assert engine_processes(control_dir) == []
        log = (Path(f"{control_dir}.instances") / instance / control.ENGINE_LOG).read_text()
        assert "that activates this tree has been silent" in log, log[-2000:]
        ps = json_of(run_vsnap("ps", "--json"))
        assert [i["id"] for i in ps["instances"] if i["id"] == instance] == []
        assert [name for name in os.listdir("/dev/shm") if instance in name] == []
    finally:
        run_vsnap("stop", instance)
