"""Standbys, for real (CPU engine, real CRIU): `vsnap restore --standby` brings the tree back and
leaves it waiting without a port; `vsnap activate` serves it with the oracle; stop, owner death and
a recaptured image are handled like any instance's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import VSNAP, engine_processes
from tests.integration.conftest import run_vsnap, write_spec
from tests.integration.test_cpu_roundtrip import assert_serves_oracle
from vsnap import read_manifest
from vsnap.host.instances import InstanceRecord, running_instances
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


def foreground_standby(image: Path) -> tuple[subprocess.Popen[str], InstanceRecord]:
    """`vsnap restore --standby` in the foreground (it owns the standby), once its standby waits."""
    owner = subprocess.Popen([VSNAP, "restore", str(image), "--standby"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not [r for r in records(image) if r.state == "standby"]:
        assert owner.poll() is None and time.monotonic() < deadline, owner.communicate()
        time.sleep(0.2)
    [record] = records(image)
    return owner, record


def health(url: str) -> int:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=30) as response:
            return int(response.status)
    except OSError as exc:
        return -1 if not isinstance(exc, urllib.error.HTTPError) else exc.code


def test_a_standby_whose_owner_dies_goes_away(image: Path) -> None:
    """A foreground standby (no --detach) is owned by its vsnap process, like a foreground restore."""
    control_dir = Path(read_manifest(image).control_dir)
    owner, _ = foreground_standby(image)
    try:
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


@pytest.mark.parametrize("owner_dies", ["before activate", "while activating"])
def test_an_activated_standby_whose_owner_died_keeps_serving(image: Path, owner_dies: str) -> None:
    """Hostile pass 14: the activation of a foreground standby whose `vsnap restore --standby` was
    SIGKILLed reported that it serves, and the tree's owner watch ended it ~10 s later. Now the
    activation beats owner.json meanwhile, and leaves the tree detached if its owner is gone."""
    manifest = read_manifest(image)
    control_dir = Path(manifest.control_dir)
    owner, record = foreground_standby(image)
    activation = None
    try:
        if owner_dies == "before activate":
            os.kill(owner.pid, signal.SIGKILL)
            owner.wait()
        stall = {"VSNAP_FAILPOINT": "stall recover"} if owner_dies == "while activating" else {}
        activation = subprocess.Popen([VSNAP, "activate", record.id, "--port", "0", "--json"],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      env={**os.environ, **stall})
        if owner_dies == "while activating":
            deadline = time.monotonic() + 60
            while [r.state for r in records(image)] != ["activating"]:
                assert activation.poll() is None and time.monotonic() < deadline, activation.communicate()
                time.sleep(0.01)
            os.kill(owner.pid, signal.SIGKILL)
            owner.wait()
        out, err = activation.communicate(timeout=300)
        assert activation.returncode == 0, err
        url = json.loads(out)["url"]
        watched_until = time.monotonic() + control.OWNER_TIMEOUT_S + 6  # past the owner watch's timeout
        while time.monotonic() < watched_until:
            assert health(url) == 200, (Path(f"{control_dir}.instances") / record.id / control.ENGINE_LOG).read_text()
            time.sleep(1)
        assert_serves_oracle(url, manifest.oracle, manifest.launch.oracle_top_k)
        assert [r.state for r in records(image)] == ["serving"]
        assert json.loads((Path(f"{control_dir}.instances") / record.id / control.OWNER).read_text())["detached"]
    finally:
        for process in (owner, activation):
            if process is not None and process.poll() is None:
                process.kill()
        run_vsnap("stop", record.id)
    assert engine_processes(control_dir) == []


def test_an_activated_foreground_standby_stays_its_owners(image: Path) -> None:
    """Its owner alive, the activation hands the tree back: the owner's death still ends it."""
    control_dir = Path(read_manifest(image).control_dir)
    owner, record = foreground_standby(image)
    try:
        activated = run_vsnap("activate", record.id, "--port", "0", "--json")
        assert activated.returncode == 0, activated.stderr
        assert health(json_of(activated)["url"]) == 200
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait()
        deadline = time.monotonic() + control.OWNER_TIMEOUT_S + 15
        while (engine_processes(control_dir) or records(image)) and time.monotonic() < deadline:
            time.sleep(0.25)
        assert engine_processes(control_dir) == [] and records(image) == []
    finally:
        if owner.poll() is None:
            owner.kill()
        run_vsnap("stop", record.id)


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


# Where `vsnap activate` is SIGKILLed (VSNAP_FAILPOINT; "activation.json": by the test, as soon as
# the activator asked the tree to recover, while the engine reloads its weights and runs its oracle).
# "after verify image" is the CPU engine's "after cuda restore": the standby is claimed (its record
# "activating", the activator beating), its state restored, recovery not yet asked for.
ACTIVATOR_KILL_POINTS = ["after verify image", "recover", "activation.json", "after recover", "serve", "after serve"]


def kill_activator(instance: str, point: str, activation_json: Path) -> subprocess.CompletedProcess[str]:
    if point != "activation.json":
        return subprocess.run([VSNAP, "activate", instance, "--port", "0"], capture_output=True, text=True,
                              timeout=120, env={**os.environ, "VSNAP_FAILPOINT": point})
    activator = subprocess.Popen([VSNAP, "activate", instance, "--port", "0"], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not activation_json.exists():
        assert activator.poll() is None and time.monotonic() < deadline, activator.communicate()
        time.sleep(0.001)
    activator.kill()
    out, err = activator.communicate()
    return subprocess.CompletedProcess(activator.args, activator.returncode, out, err)


@pytest.mark.parametrize("point", ACTIVATOR_KILL_POINTS)
def test_an_activator_killed_midway_ends_the_tree_within_seconds(image: Path, point: str) -> None:
    """Issue 26, item 5: a `vsnap activate` SIGKILLed after it began bringing a detached standby up
    (no owner watches it) must not leave the tree holding what it restored (on a GPU: its memory).
    The tree watches the activator's heartbeat and ends itself; `vsnap ps` then prunes the record
    and the /dev/shm directory. Without it the tree waited for its activation without a timeout
    ("after verify image", "recover") or for its socket until timeout_s ("after recover", "serve"),
    and served on with a record that says "activating" ("after serve")."""
    control_dir = Path(read_manifest(image).control_dir)
    waiting = json_of(run_vsnap("restore", str(image), "--standby", "--detach", "--json"))
    instance = waiting["instance"]
    try:
        killed = kill_activator(instance, point, Path(f"{control_dir}.instances") / instance / control.ACTIVATION)
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


def test_an_activator_killed_before_it_claims_the_standby_leaves_it_standing_by(image: Path) -> None:
    """Killed while it verifies the image (before the record says "activating" and before its
    heartbeat): nothing of the standby was touched, so it waits on, and activates later."""
    manifest = read_manifest(image)
    waiting = json_of(run_vsnap("restore", str(image), "--standby", "--detach", "--json"))
    instance = waiting["instance"]
    try:
        killed = subprocess.run([VSNAP, "activate", instance, "--port", "0"], capture_output=True, text=True,
                                timeout=120, env={**os.environ, "VSNAP_FAILPOINT": "verify image"})
        assert killed.returncode == -signal.SIGKILL, killed.stderr
        time.sleep(control.ACTIVATOR_TIMEOUT_S + 2)  # what an activator's silence would have taken
        assert [r.state for r in records(image)] == ["standby"]
        assert engine_processes(Path(manifest.control_dir)) == [waiting["pid"]]
        served = run_vsnap("activate", instance, "--port", "0", "--json")
        assert served.returncode == 0, served.stderr
        assert_serves_oracle(json_of(served)["url"], manifest.oracle, manifest.launch.oracle_top_k)
    finally:
        run_vsnap("stop", instance)
    assert engine_processes(Path(manifest.control_dir)) == []
