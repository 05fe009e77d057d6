"""The repository's Kubernetes manifests played by `podman kube play` (podman 4.3, Debian's).

deploy/kubernetes/capture-job.yaml (its ConfigMap and the Job's pod) and serve-deployment.yaml
(the Deployment) are read and changed only where a CPU machine without a registry or a GPU needs
it, each change listed in `played`: the model.yaml of the ConfigMap becomes one for the built-in
CPU engine (same name, image path and control directory); the GPU limit and node selector go; the
hostPath of the images is a directory of the test's; the capture Job's push container (it needs a
registry the pod cannot reach) lists the image instead; and every container gets this host's
toolchain (/usr, /lib, ... and this checkout with its .venv) as read-only hostPath volumes, since
the manifests' container image (vsnap-vllm, with vLLM and CRIU) does not exist here: a local image
of that name holds only empty directories. Everything else is played as written: the commands, the
privileged securityContext, the init containers, the volumes (images, models read-only, the spec
from the ConfigMap, /dev/shm a memory emptyDir), the probes as podman takes them.

The capture Job's pod captures; the Deployment's pod waits for the image (its init container),
restores it with `vsnap serve` (the readiness file appears, the server answers a completion from
inside the pod), and is taken down: nothing of it stays running. As in
test_container_privileges.py, podman runs in a mount namespace without the cgroup v2 hierarchy
(crun 1.8 refuses these hybrid hosts) and with rlimits no higher than the VM's (CONTAINERS_CONF).
"""

from __future__ import annotations

import copy
import os
import resource
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

yaml = pytest.importorskip("yaml")

pytestmark = [pytest.mark.criu, pytest.mark.container]

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy" / "kubernetes"
IMAGE = "registry.example.com/vsnap/vsnap-vllm:0.2.0"
TOOLCHAIN = ("/usr", "/bin", "/sbin", "/lib", "/lib64", str(Path(os.path.realpath(os.sys.executable)).parents[2]),
             str(REPO))
SPEC = """\
name: llama-8b
engine: cpu
image: /var/lib/vsnap/images/llama-8b
serve:
  max_model_len: 256
snapshot:
  control_dir: /run/vsnap/llama-8b
  timeout_s: 120
oracle:
  prompts: ["The capital of France is", "1, 2, 3, 5, 8,"]
  max_tokens: 8
"""


def _documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _one(documents: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (found,) = [d for d in documents if d["kind"] == kind]
    return copy.deepcopy(found)


def _for_this_host(pod_spec: dict[str, Any], images: Path, played: list[str]) -> None:
    """The changes a CPU machine without a registry needs, each said in ``played``."""
    pod_spec.pop("nodeSelector", None)
    volumes = pod_spec["volumes"]
    for volume in volumes:
        if volume["name"] == "images":
            volume["hostPath"] = {"path": str(images), "type": "Directory"}
    toolchain = [(f"toolchain-{i}", path) for i, path in enumerate(p for p in TOOLCHAIN if os.path.isdir(p))]
    volumes += [{"name": name, "hostPath": {"path": path, "type": "Directory"}} for name, path in toolchain]
    for container in pod_spec.get("initContainers", []) + pod_spec["containers"]:
        container.get("resources", {}).get("limits", {}).pop("nvidia.com/gpu", None)
        container.setdefault("volumeMounts", []).extend(
            {"name": name, "mountPath": path, "readOnly": True} for name, path in toolchain)
        container.setdefault("env", []).append({"name": "PATH", "value": f"{REPO}/.venv/bin:/usr/bin:/bin"})
    played += ["nodeSelector and the nvidia.com/gpu limit removed", f"the images hostPath is {images}",
               "this host's toolchain as read-only hostPath volumes: " + ", ".join(p for _, p in toolchain)]


class Kube:
    def __init__(self, state: Path) -> None:
        self.state = state
        self.conf = state / "containers.conf"
        nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        nofile = 1 << 20 if nofile == resource.RLIM_INFINITY else nofile
        self.conf.write_text(f'[containers]\ndefault_ulimits = ["nofile={nofile}:{nofile}", "nproc=4096:4096"]\n')

    def podman(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        hybrid = Path("/sys/fs/cgroup/unified/cgroup.controllers")
        umount = "umount /sys/fs/cgroup/unified; " if hybrid.exists() and hybrid.read_text().strip() else ""
        return subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", umount + 'exec "$@"', "sh",
                               "podman", *args], capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, "CONTAINERS_CONF": str(self.conf)})

    def play(self, name: str, documents: list[dict[str, Any]], configmap: dict[str, Any]) -> Path:
        path, cm = self.state / f"{name}.yaml", self.state / f"{name}-configmap.yaml"
        path.write_text(yaml.safe_dump_all(documents))
        cm.write_text(yaml.safe_dump(configmap))
        out = self.podman("kube", "play", "--replace", "--network", "none", "--configmap", str(cm), str(path))
        assert out.returncode == 0, out.stdout + out.stderr
        return path

    def logs(self, container: str) -> str:
        out = self.podman("logs", container)
        return out.stdout + out.stderr

    def state_of(self, container: str) -> str:
        return self.podman("inspect", "--format", "{{.State.Status}} {{.State.ExitCode}}", container).stdout.strip()

    def wait_exited(self, container: str, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            state = self.state_of(container)
            if state.startswith("exited"):
                return state
            time.sleep(1)
        return self.state_of(container)


@pytest.fixture(scope="module")
def kube(tmp_path_factory: pytest.TempPathFactory) -> Kube:
    if os.geteuid() != 0:
        pytest.skip("needs root")
    missing = [tool for tool in ("podman", "catatonit") if shutil.which(tool) is None]
    if missing:
        if os.environ.get("VSNAP_REQUIRE_PODMAN"):
            pytest.fail(f"{', '.join(missing)} not installed (make system installs them)")
        pytest.skip(f"{', '.join(missing)} not installed")
    kube = Kube(tmp_path_factory.mktemp("kube"))
    empty = kube.state / "rootfs"
    for directory in ("bin", "sbin", "usr", "lib", "lib64", "etc", "tmp", "run", "var/lib/vsnap", "root", "work"):
        (empty / directory).mkdir(parents=True, exist_ok=True)
    if kube.podman("image", "exists", IMAGE).returncode != 0:  # the manifests' image, as empty directories
        subprocess.run(["tar", "-C", str(empty), "-cf", str(kube.state / "rootfs.tar"), "."], check=True)
        out = kube.podman("import", "-q", str(kube.state / "rootfs.tar"), IMAGE)
        assert out.returncode == 0, out.stderr
    return kube


def test_the_capture_job_and_the_deployment_play_in_podman(kube: Kube, tmp_path: Path) -> None:
    images = tmp_path / "images"
    images.mkdir(mode=0o700)
    capture_docs = _documents(DEPLOY / "capture-job.yaml")
    configmap = _one(capture_docs, "ConfigMap")
    configmap["data"]["model.yaml"] = SPEC
    played = ["the ConfigMap's model.yaml is the built-in CPU engine's (same name, image and control_dir)"]

    job = _one(capture_docs, "Job")
    pod_spec = job["spec"]["template"]["spec"]
    push = pod_spec["containers"][0]
    assert push["name"] == "push" and push["command"][:2] == ["vsnap", "push"]
    push["command"] = ["vsnap", "images", "/var/lib/vsnap/images/llama-8b"]
    push["volumeMounts"] = [m for m in push["volumeMounts"] if m["name"] != "registry-auth"]
    pod_spec["volumes"] = [v for v in pod_spec["volumes"] if v["name"] != "registry-auth"]
    played.append("the Job's push container lists the image instead (no registry is reachable from the pod)")
    _for_this_host(pod_spec, images, played)
    capture_pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "vsnap-capture"}, "spec": pod_spec}
    played.append("the Job's pod template is played as a Pod (podman 4.3 plays no Job)")
    capture_file = kube.play("capture", [capture_pod], configmap)
    try:
        state = kube.wait_exited("vsnap-capture-push", 240)
        assert state == "exited 0", state + kube.logs("vsnap-capture-capture") + kube.logs("vsnap-capture-push")
        listed = kube.logs("vsnap-capture-push")  # (podman removes an init container once it ran)
        assert "llama-8b" in listed and "captured" in listed, listed
    finally:
        kube.podman("kube", "down", str(capture_file))

    deployment = _one(_documents(DEPLOY / "serve-deployment.yaml"), "Deployment")
    deployment["spec"]["replicas"] = 1
    for container in deployment["spec"]["template"]["spec"]["containers"]:
        container.pop("ports", None)
        for probe in ("startupProbe", "livenessProbe"):  # they name the port by the name `ports` gave it
            if container.get(probe, {}).get("httpGet", {}).get("port") == "http":
                container[probe]["httpGet"]["port"] = 8000
    deployment["spec"]["template"]["spec"]["restartPolicy"] = "OnFailure"
    played.append("the Deployment's pod restartPolicy OnFailure (under Always, podman 4.3 restarts the init "
                  "container that exited 0, then fails to remove it)")
    played.append("the Deployment's containerPort removed and its probes given port 8000 (podman publishes a "
                  "containerPort, which needs a bridge network; the pods run with --network none)")
    _for_this_host(deployment["spec"]["template"]["spec"], images, played)
    served = kube.play("serve", [deployment], configmap)
    pod = "llama-8b-pod-0"  # podman names a Deployment's pod NAME-pod-N
    try:
        deadline, answer = time.monotonic() + 120, None
        while time.monotonic() < deadline:
            ready = kube.podman("exec", f"{pod}-server", "test", "-f", "/run/vsnap-serve/ready")
            if ready.returncode == 0:
                answer = kube.podman("exec", f"{pod}-server", "python", "-c", (
                    "import json, urllib.request; r = urllib.request.Request('http://127.0.0.1:8000/v1/completions', "
                    "data=json.dumps({'prompt': 'The capital of France is', 'max_tokens': 4}).encode(), "
                    "headers={'content-type': 'application/json'}); "
                    "print(len(json.load(urllib.request.urlopen(r, timeout=30))['choices'][0]['token_ids']))"))
                break
            time.sleep(1)
        logs = kube.logs(f"{pod}-server")
        assert answer is not None and answer.stdout.strip() == "4", logs + str(answer) + kube.logs(f"{pod}-wait-for-image")
        assert '"event": "ready"' in logs and '"how": "restored"' in logs, logs  # from the image, not cold
    finally:
        down = kube.podman("kube", "down", str(served), timeout=120)
    assert down.returncode == 0, down.stderr
    assert kube.podman("ps", "-a", "--filter", f"name={pod}", "--format", "{{.Names}}").stdout.strip() == ""
    print("played with these changes:\n  " + "\n  ".join(played))
