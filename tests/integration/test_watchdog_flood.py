"""Clients cannot end a restored server (issue 26, item 3; CPU engine, real CRIU): a flood of idle
connections from an unprivileged user, more than the tree has descriptors, leaves it serving,
and its watchdog does not read "Too many open files" as "the owner is gone"; a flood of requests
that never finish their body neither locks clients out nor holds a connection past its deadline
(hostile pass 14)."""

from __future__ import annotations

import json
import re
import resource
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest

from tests.conftest import VSNAP, engine_processes
from tests.integration.conftest import run_vsnap, write_spec
from tests.integration.test_cpu_roundtrip import assert_serves_oracle
from vsnap import read_manifest
from vsnap.engine.adapters.cpu.connections import REQUEST_S
from vsnap.protocol import control

pytestmark = pytest.mark.criu

CAPTURE_SOFT_NOFILE = 128  # the capturing shell's `ulimit -Sn`: the tree must not keep it
TREE_NOFILE = 200  # what the test then gives the restored tree, so that a flood can exceed it
FLOOD = TREE_NOFILE + 150
NOBODY = 65534

# The flood, as nobody, with the system's python (stdlib only): it connects FLOOD times, says how
# many connected, and holds them until its stdin closes.
FLOOD_SCRIPT = """
import socket, sys
port, count = int(sys.argv[1]), int(sys.argv[2])
held = []
for _ in range(count):
    try:
        held.append(socket.create_connection(("127.0.0.1", port), timeout=5))
    except OSError:
        pass
print(len(held), flush=True)
sys.stdin.read()
"""


# The same as nobody, each connection a completion request whose body stops after its first bytes.
# Once stdin says the test was answered, it drips a byte a second into every connection still open
# (no drip may extend a request's deadline) and says how many remain open when the server has
# closed them all, or when it gives up.
HALF_BODY_SCRIPT = """
import socket, sys, time
port, count, give_up_s = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
head = (b"POST /v1/completions HTTP/1.1\\r\\nHost: x\\r\\nContent-Type: application/json\\r\\n"
        b"Content-Length: 100\\r\\n\\r\\n{\\"prompt\\": \\"")
held = []
for _ in range(count):
    try:
        conn = socket.create_connection(("127.0.0.1", port), timeout=5)
        conn.sendall(head)
        held.append(conn)
    except OSError:
        pass
print(len(held), flush=True)
sys.stdin.readline()
end = time.monotonic() + give_up_s
while held and time.monotonic() < end:
    time.sleep(1)
    still = []
    for conn in held:
        conn.setblocking(False)
        try:
            if conn.recv(1) == b"":
                continue
        except BlockingIOError:
            pass
        except OSError:
            continue
        try:
            conn.send(b"a")
            still.append(conn)
        except OSError:
            pass
    held = still
print(len(held), flush=True)
"""


def nofile(pid: int) -> tuple[int, int]:
    limits = Path(f"/proc/{pid}/limits").read_text()
    found = re.search(r"^Max open files\s+(\d+)\s+(\d+)", limits, re.M)
    assert found, limits
    return int(found[1]), int(found[2])


def set_capture_limit() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (CAPTURE_SOFT_NOFILE, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    base = tmp_path_factory.mktemp("flood")
    spec = write_spec(base, "cpu-flood")
    result = subprocess.run([VSNAP, "capture", str(spec), "--json"], capture_output=True, text=True, timeout=300,
                            preexec_fn=set_capture_limit)
    assert result.returncode == 0, result.stderr
    yield Path(json.loads(result.stdout)["image"])


def get(url: str, path: str) -> int:
    with urllib.request.urlopen(f"{url}{path}", timeout=30) as response:
        return int(response.status)


def test_a_flood_of_idle_connections_beyond_the_fd_limit_leaves_the_restored_server_serving(image: Path) -> None:
    manifest = read_manifest(image)
    control_dir = Path(manifest.control_dir)
    waiting = json.loads(run_vsnap("restore", str(image), "--standby", "--detach", "--json").stdout)
    instance, pid = waiting["instance"], waiting["pid"]
    flood = None
    try:
        soft, hard = nofile(pid)
        assert soft == hard and soft > CAPTURE_SOFT_NOFILE  # launched with a sane limit; CRIU kept it
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (TREE_NOFILE, TREE_NOFILE))  # lowering takes no privilege
        served = run_vsnap("activate", instance, "--port", "0", "--json")
        assert served.returncode == 0, served.stderr
        url = json.loads(served.stdout)["url"]
        port = url.rsplit(":", 1)[1]
        flood = subprocess.Popen(["/usr/bin/python3", "-c", FLOOD_SCRIPT, port, str(FLOOD)], user=NOBODY,
                                 cwd="/", stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert flood.stdout is not None
        connected = int(flood.stdout.readline())
        assert connected > TREE_NOFILE, connected
        time.sleep(control.OWNER_TIMEOUT_S + 3)  # the watchdog looked a dozen times meanwhile
        assert engine_processes(control_dir) == [pid]
        assert get(url, "/health") == 200
        assert_serves_oracle(url, manifest.oracle, manifest.launch.oracle_top_k)
        log = (Path(f"{control_dir}.instances") / instance / control.ENGINE_LOG).read_text()
        assert "shutting down" not in log, log[-2000:]
    finally:
        if flood is not None:
            flood.kill()
            flood.wait()
        run_vsnap("stop", instance)
    assert engine_processes(control_dir) == []


def test_a_flood_of_unfinished_bodies_leaves_the_server_answering_and_is_closed_by_its_deadline(image: Path) -> None:
    """Hostile pass 14: requests that sent their headers and part of their body counted as busy
    forever, so that once they filled the connection cap the server closed every new client."""
    manifest = read_manifest(image)
    control_dir = Path(manifest.control_dir)
    waiting = json.loads(run_vsnap("restore", str(image), "--standby", "--detach", "--json").stdout)
    instance, pid = waiting["instance"], waiting["pid"]
    flood = None
    try:
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (TREE_NOFILE, TREE_NOFILE))  # a cap below the flood
        served = run_vsnap("activate", instance, "--port", "0", "--json")
        assert served.returncode == 0, served.stderr
        url = json.loads(served.stdout)["url"]
        give_up_s = REQUEST_S * 6  # far past the deadline: only so that a failing test ends
        flood = subprocess.Popen(["/usr/bin/python3", "-c", HALF_BODY_SCRIPT, url.rsplit(":", 1)[1], str(FLOOD),
                                  str(give_up_s)], user=NOBODY, cwd="/", stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)
        assert flood.stdout is not None and flood.stdin is not None
        assert int(flood.stdout.readline()) > TREE_NOFILE  # more than the server may hold at once
        assert_serves_oracle(url, manifest.oracle, manifest.launch.oracle_top_k)
        flood.stdin.write("answered\n")
        flood.stdin.flush()
        still_open = flood.stdout.readline()
        assert still_open.strip() == "0", "the server kept connections whose bodies never came"
        assert get(url, "/health") == 200
        log = (Path(f"{control_dir}.instances") / instance / control.ENGINE_LOG).read_text()
        assert "shutting down" not in log and "Traceback" not in log, log[-2000:]
    finally:
        if flood is not None:
            flood.kill()
            flood.wait()
        run_vsnap("stop", instance)
    assert engine_processes(control_dir) == []
