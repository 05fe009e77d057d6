"""The pod's privileges, proven in a real container runtime (podman, Debian's package).

The Deployment's container (deploy/kubernetes/serve-deployment.yaml) runs `vsnap serve` with
`privileged: true` and the volumes of the manifest (the images hostPath, the models read-only, the
spec read-only, /dev/shm a memory emptyDir); the capture Job runs `vsnap capture` in the same
shape. Here podman starts such a container, with the host's own root as its (copy-on-write) image,
so it holds this checkout's vsnap, its .venv and the CRIU that scripts/criu/ built: the capture
Job's command, then the Deployment's, a completion through the served port, a SIGTERM, and
nothing left running.

Then the narrower set docs/fleet.md states (CAP_SYS_ADMIN, CAP_NET_ADMIN, CAP_SYS_TIME, seccomp
and AppArmor unconfined, /proc unmasked) restores too, and without each of them in turn (and as
vsnap refuses in one line naming what is missing, with nothing left
running in the container. AppArmor cannot be taken away here: these kernels have none. Not root
is not tried in a container (this checkout is root's alone, so another user cannot even start
vsnap from it): tests/unit cover check_root.

podman needs two things on these VMs that a node does not: rlimits no higher than the VM's (root
lacks CAP_SYS_RESOURCE, so crun cannot raise them) and, on a host with cgroup v1 and v2 mounted
side by side, a mount namespace without the v2 hierarchy (crun 1.8 refuses such "hybrid" hosts
when a controller sits in v2); the container itself runs with --cgroups=disabled.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

from vsnap.ops.tree import resolve_model
from vsnap.spec.schema import load_spec

pytestmark = [pytest.mark.criu, pytest.mark.container]

REPO = Path(__file__).resolve().parents[2]
IMAGE_IN_CONTAINER = "/var/lib/vsnap/images/cpu-pod"
NARROW_CAPS = ("SYS_ADMIN", "NET_ADMIN", "SYS_TIME")
UNCONFINED = ("--security-opt", "seccomp=unconfined", "--security-opt", "apparmor=unconfined",
              "--security-opt", "unmask=ALL")

SPEC = f"""\
name: cpu-pod
engine: cpu
image: {IMAGE_IN_CONTAINER}
serve:
  max_model_len: 256
snapshot:
  control_dir: /run/vsnap/cpu-pod
  timeout_s: 120
oracle:
  prompts: ["The capital of France is", "1, 2, 3, 5, 8,"]
  max_tokens: 8
"""

# What the capture Job and the Deployment's container run (their commands, this checkout's vsnap),
# then a completion through the served port, SIGTERM, and what is left. One line per result.
POD = r"""
export PATH={repo}/.venv/bin:$PATH
vsnap capture /etc/vsnap/model.yaml --force > /tmp/capture.log 2>&1
echo "capture_rc=$?"
vsnap serve /etc/vsnap/model.yaml --host 0.0.0.0 --port 8000 --ready-file /run/vsnap-serve/ready \
  > /tmp/serve.jsonl 2> /tmp/serve.err &
serve=$!
for i in $(seq 1 240); do [ -f /run/vsnap-serve/ready ] && break; sleep 0.25; done
echo "ready_file=$([ -f /run/vsnap-serve/ready ] && echo yes || echo no)"
python - <<'EOF'
import json, urllib.request
request = urllib.request.Request("http://127.0.0.1:8000/v1/completions", method="POST",
    data=json.dumps({{"prompt": "The capital of France is", "max_tokens": 4}}).encode(),
    headers={{"content-type": "application/json"}})
try:
    body = json.load(urllib.request.urlopen(request, timeout=30))
    print("completion_tokens=" + str(len(body["choices"][0]["token_ids"])))
except Exception as exc:
    print("completion_error=" + type(exc).__name__)
EOF
kill -TERM $serve; wait $serve
echo "serve_rc=$?"
echo "ready_file_after=$([ -f /run/vsnap-serve/ready ] && echo yes || echo no)"
grep '"event": "ready"' /tmp/serve.jsonl | head -1 | sed 's/^/ready_event=/'
echo "left=$(ps -e -o comm= | grep -v -x -e sh -e ps -e grep -e sort -e tr | sort | tr '\n' ' ')"
[ "$(sed -n 1p /tmp/capture.log)" ] && tail -3 /tmp/capture.log | sed 's/^/capture_log: /'
tail -3 /tmp/serve.err | sed 's/^/serve_err: /'
"""

# Each command of a pod without one privilege: its rc, its stderr, what is left running.
REFUSED = r"""
export PATH={repo}/.venv/bin:$PATH
vsnap {command} > /tmp/out 2> /tmp/err
echo "rc=$?"
sed 's/^/err: /' /tmp/err
echo "left=$(ps -e -o comm= | grep -v -x -e sh -e ps -e grep -e sort -e tr | sort | tr '\n' ' ')"
"""


def _hybrid_cgroups() -> bool:
    unified = Path("/sys/fs/cgroup/unified/cgroup.controllers")
    try:
        return unified.read_text().strip() != ""
    except OSError:
        return False


class Podman:
    """`podman run --rm` of this host's root as the container's image, with the pod's volumes."""

    def __init__(self, state: Path) -> None:
        self.images = state / "images"
        self.spec_dir = state / "spec"
        for directory in (self.images, self.spec_dir):
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        (self.spec_dir / "model.yaml").write_text(SPEC)
        self.models = resolve_model(load_spec(self.spec_dir / "model.yaml")).parent  # written once, read-only inside

    def run(self, flags: list[str], script: str, timeout: float = 240) -> dict[str, str]:
        nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        nofile = 1 << 20 if nofile == resource.RLIM_INFINITY else nofile
        name = f"vsnap-test-{uuid.uuid4().hex[:8]}"
        argv = ["podman", "run", "--rm", "--name", name, "--cgroups=disabled", "--network", "none",
                "--ulimit", f"nofile={nofile}:{nofile}", "--ulimit", "nproc=4096:4096",
                "-v", f"{self.images}:/var/lib/vsnap/images", "-v", f"{self.models}:/var/lib/vsnap/models:ro",
                "-v", f"{self.spec_dir}:/etc/vsnap:ro", "--tmpfs", "/dev/shm", "-w", str(REPO),
                *flags, "--rootfs", "/:O", "sh", "-c", script.format(repo=REPO)]
        umount = "umount /sys/fs/cgroup/unified; " if _hybrid_cgroups() else ""
        try:
            out = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c",
                                  umount + 'exec "$@"', "sh", *argv],
                                 capture_output=True, text=True, timeout=timeout)
        finally:
            subprocess.run(["podman", "rm", "-f", "--ignore", name], capture_output=True, timeout=60)
        assert "rc=" in out.stdout or "capture_rc=" in out.stdout, f"podman did not run the script: {out.stderr}"
        result: dict[str, str] = {"stdout": out.stdout, "stderr": out.stderr}
        errors = []
        for line in out.stdout.splitlines():
            key, _, value = line.partition("=")
            if line.startswith("err: "):
                errors.append(line[5:])
            elif key and value is not None and " " not in key:
                result.setdefault(key, value)
        result["err"] = "\n".join(errors)
        return result


@pytest.fixture(scope="module")
def podman(tmp_path_factory: pytest.TempPathFactory) -> Podman:
    if os.geteuid() != 0:
        pytest.skip("needs root")
    if shutil.which("podman") is None:
        if os.environ.get("VSNAP_REQUIRE_PODMAN"):
            pytest.fail("podman is not installed (make system installs it)")
        pytest.skip("podman is not installed (apt-get install podman)")
    return Podman(tmp_path_factory.mktemp("pod"))


def _caps(without: str = "") -> list[str]:
    return [f for cap in NARROW_CAPS if cap != without for f in ("--cap-add", cap)]


def _assert_served(result: dict[str, str]) -> None:
    context = result["stdout"] + result["stderr"]
    assert result.get("capture_rc") == "0", context
    assert result.get("ready_file") == "yes", context
    ready = json.loads(result["ready_event"])
    assert ready["how"] == "restored", ready  # from the image, not the cold fallback
    assert result.get("completion_tokens") == "4", context
    assert result.get("serve_rc") == "0", context  # SIGTERM: a clean stop
    assert result.get("ready_file_after") == "no", context
    assert result.get("left", "").split() == [], context  # no engine, no criu, no vsnap


def test_the_manifests_privileged_pod_captures_restores_serves_and_stops_clean(podman: Podman) -> None:
    _assert_served(podman.run(["--privileged"], POD))


def test_the_narrow_set_of_docs_fleet_is_enough(podman: Podman) -> None:
    _assert_served(podman.run([*_caps(), *UNCONFINED], POD))


@pytest.mark.parametrize("flags, named", [
    pytest.param([*_caps("SYS_ADMIN"), *UNCONFINED], "CAP_SYS_ADMIN", id="no-CAP_SYS_ADMIN"),
    pytest.param([*_caps("NET_ADMIN"), *UNCONFINED], "CAP_NET_ADMIN", id="no-CAP_NET_ADMIN"),
    pytest.param([*_caps(), "--security-opt", "apparmor=unconfined", "--security-opt", "unmask=ALL"],
                 "seccomp filter", id="default-seccomp"),
    pytest.param([*_caps(), "--security-opt", "seccomp=unconfined", "--security-opt", "apparmor=unconfined"],
                 "masked /proc", id="masked-proc"),
])
def test_without_a_privilege_a_capture_is_refused_naming_it(podman: Podman, flags: list[str], named: str) -> None:
    result = podman.run(flags, REFUSED.replace("{command}", "capture /etc/vsnap/model.yaml --force"))
    assert result["rc"] == "3", result  # HostNotReady
    lines = [line for line in result["err"].splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and named in lines[0], result["err"]
    assert result["left"].split() == [], result


@pytest.mark.parametrize("flags, named", [
    pytest.param([*_caps("SYS_TIME"), *UNCONFINED], "CAP_SYS_TIME", id="no-CAP_SYS_TIME"),
    pytest.param([*_caps("SYS_ADMIN"), *UNCONFINED], "CAP_SYS_ADMIN", id="no-CAP_SYS_ADMIN"),
    pytest.param([*_caps(), "--security-opt", "apparmor=unconfined", "--security-opt", "unmask=ALL"],
                 "seccomp filter", id="default-seccomp"),
    pytest.param([*_caps(), "--security-opt", "seccomp=unconfined", "--security-opt", "apparmor=unconfined"],
                 "masked /proc", id="masked-proc"),
])
def test_without_a_privilege_a_restore_is_refused_naming_it(podman: Podman, flags: list[str], named: str) -> None:
    image = podman.images / "cpu-pod"
    if not (image / "manifest.json").exists():  # the image of the served pods' tests (or capture one here)
        assert podman.run([*_caps(), *UNCONFINED], POD).get("capture_rc") == "0"
    result = podman.run(flags, REFUSED.replace("{command}", f"restore {IMAGE_IN_CONTAINER} --port 8000"))
    assert result["rc"] == "3", result
    lines = [line for line in result["err"].splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and named in lines[0], result["err"]
    assert result["left"].split() == [], result
