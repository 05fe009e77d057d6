"""Every Kubernetes manifest in deploy/kubernetes/ loads through the `kubernetes` client's models,
exactly: ApiClient.deserialize checks the types (strict: `replicas: "2"` fails), and the object
serialized back must equal the document, so a field the models do not know (which they would
silently drop), a Python-style name (`container_port`) or a coerced value fails too. Then what
the fleet relies on across files: the capture pod and the serving pod mount the same paths (the
image records the capture's mounts; a restore needs each again), one container image, the
restored port is the probed one, and docs/fleet.md names every file."""

from __future__ import annotations

import copy
import json
import re
import shlex
from pathlib import Path
from typing import Any

import kubernetes.client.models as k8s_models  # the dev extra installs it: no skip that could hide its absence
import pytest
import yaml
from kubernetes.client import ApiClient

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy" / "kubernetes"
FLEET_DOC = ROOT / "docs" / "fleet.md"
MANIFESTS = sorted(DEPLOY.glob("*.yaml"))


class ManifestError(AssertionError):
    pass


def documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def model_name(doc: dict[str, Any]) -> str:
    """The client's model for a document: apps/v1 Deployment -> V1Deployment."""
    version = str(doc.get("apiVersion", "")).rsplit("/", 1)[-1]
    name = f"{version[:1].upper()}{version[1:]}{doc.get('kind', '')}"
    if not hasattr(k8s_models, name):
        raise ManifestError(f"no model {name} for apiVersion {doc.get('apiVersion')!r}, kind {doc.get('kind')!r}")
    return name


def first_difference(given: Any, back: Any, where: str = "") -> str | None:
    if isinstance(given, dict) and isinstance(back, dict):
        for key in sorted(set(given) | set(back)):
            if key not in back:
                return f"{where}.{key}: not a field of the model (dropped)"
            if key not in given:
                return f"{where}.{key}: added by the model"
            found = first_difference(given[key], back[key], f"{where}.{key}")
            if found:
                return found
        return None
    if isinstance(given, list) and isinstance(back, list):
        if len(given) != len(back):
            return f"{where}: {len(given)} items, {len(back)} after the round trip"
        for index, (a, b) in enumerate(zip(given, back)):
            found = first_difference(a, b, f"{where}[{index}]")
            if found:
                return found
        return None
    if type(given) is not type(back) or given != back:
        return f"{where}: {given!r} became {back!r}"
    return None


def load(doc: dict[str, Any]) -> Any:
    """The document as the client's model object; ManifestError naming the first problem."""
    api = ApiClient()
    name = model_name(doc)
    try:
        obj = api.deserialize(json.dumps(doc), name, None)
    except Exception as exc:  # pydantic's ValidationError, or the client's own errors
        raise ManifestError(f"{doc.get('kind')} {doc.get('metadata', {}).get('name')}: {exc}") from None
    back = api.sanitize_for_serialization(obj)
    problem = first_difference(doc, back)
    if problem:
        raise ManifestError(f"{doc.get('kind')} {doc.get('metadata', {}).get('name')}: {problem.lstrip('.')}")
    return obj


def by_kind() -> dict[str, dict[str, Any]]:
    found = {}
    for path in MANIFESTS:
        for doc in documents(path):
            found[f"{doc['kind']}/{doc['metadata']['name']}"] = doc
    return found


# --- every manifest loads exactly ------------------------------------------------------------------


def test_the_manifests_are_there() -> None:
    assert [p.name for p in MANIFESTS] == ["capture-job.yaml", "namespace.yaml", "prepull-daemonset.yaml",
                                           "serve-deployment.yaml"]
    assert sorted(by_kind()) == ["ConfigMap/vsnap-model-llama-8b", "ConfigMap/vsnap-prepull",
                                 "DaemonSet/vsnap-prepull", "Deployment/llama-8b", "Job/vsnap-capture-llama-8b",
                                 "Namespace/vsnap", "Service/llama-8b"]


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_each_document_loads_through_the_client_models(path: Path) -> None:
    for doc in documents(path):
        obj = load(doc)
        assert type(obj).__name__ == model_name(doc)


# --- the check itself fails where it must ----------------------------------------------------------


def deployment() -> dict[str, Any]:
    return copy.deepcopy(by_kind()["Deployment/llama-8b"])


def server(doc: dict[str, Any]) -> dict[str, Any]:
    return doc["spec"]["template"]["spec"]["containers"][0]


def mutated(change) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    doc = deployment()
    change(doc)
    return doc


@pytest.mark.parametrize("change,message", [
    (lambda d: server(d).update(imagePulPolicy="Always"), "imagePulPolicy: not a field of the model"),
    (lambda d: d["spec"].update(replica=2), "spec.replica: not a field of the model"),
    (lambda d: d["spec"]["template"]["spec"].update(hostPid=False), "hostPid: not a field of the model"),
    (lambda d: server(d)["ports"][0].update(container_port=8000), "container_port: not a field of the model"),
    (lambda d: d["spec"].update(replicas="2"), "replicas"),
    (lambda d: server(d)["ports"][0].update(containerPort="8000"), "containerPort"),
    (lambda d: server(d)["securityContext"].update(privileged="true"), "privileged"),
    (lambda d: server(d)["resources"]["limits"].update({"nvidia.com/gpu": 1}), "limits"),
    (lambda d: server(d).update(args="exec vsnap restore"), "args"),
    (lambda d: server(d).pop("name"), "name"),
    (lambda d: d.update(kind="Deploymnet"), "no model V1Deploymnet"),
])
def test_an_unknown_or_mistyped_field_fails(change, message: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ManifestError, match=re.escape(message)):
        load(mutated(change))


def test_the_unchanged_document_passes_the_same_check() -> None:
    load(deployment())


# --- what the fleet relies on across the files -----------------------------------------------------


def pod(doc: dict[str, Any]) -> dict[str, Any]:
    return doc["spec"]["template"]["spec"]


def container(doc: dict[str, Any], name: str) -> dict[str, Any]:
    spec = pod(doc)
    return next(c for c in spec.get("initContainers", []) + spec["containers"] if c["name"] == name)


def mounts(doc: dict[str, Any], name: str) -> dict[str, tuple[str, Any]]:
    """mountPath -> (read-only?, the volume's source) of one container."""
    volumes = {v["name"]: {k: v for k, v in v.items() if k != "name"} for v in pod(doc)["volumes"]}
    return {m["mountPath"]: (m.get("readOnly", False), volumes[m["name"]]) for m in container(doc, name)["volumeMounts"]}


def test_capture_and_serving_containers_are_the_same_software_with_the_same_mounts() -> None:
    docs = by_kind()
    job, serve = docs["Job/vsnap-capture-llama-8b"], docs["Deployment/llama-8b"]
    capture, server_ = container(job, "capture"), container(serve, "server")
    assert capture["image"] == server_["image"]  # restore compares Python, torch, vLLM... with the capture's
    assert mounts(job, "capture") == mounts(serve, "server")
    for doc in (job, serve):
        spec = pod(doc)
        assert spec["hostPID"] is False and spec["hostNetwork"] is False and spec["hostIPC"] is False
        assert spec["automountServiceAccountToken"] is False  # no token volume for the image to record
    for c in (capture, server_):
        assert c["securityContext"]["privileged"] is True and c["resources"]["limits"]["nvidia.com/gpu"] == "1"


def test_only_the_capture_and_the_restore_are_privileged() -> None:
    docs = by_kind()
    others = [(docs["Job/vsnap-capture-llama-8b"], "push"), (docs["Deployment/llama-8b"], "wait-for-image"),
              (docs["DaemonSet/vsnap-prepull"], "prepull")]
    for doc, name in others:
        context = container(doc, name)["securityContext"]
        assert "privileged" not in context and context["allowPrivilegeEscalation"] is False
        assert context["capabilities"] == {"drop": ["ALL"]}


def model_spec() -> dict[str, Any]:
    return yaml.safe_load(by_kind()["ConfigMap/vsnap-model-llama-8b"]["data"]["model.yaml"])


def test_the_model_spec_is_a_valid_vsnap_spec() -> None:
    from vsnap.spec.schema import _parse_yaml, spec_from_data

    text = by_kind()["ConfigMap/vsnap-model-llama-8b"]["data"]["model.yaml"]
    data, positions, bad = _parse_yaml(text, "model.yaml")
    spec = spec_from_data(data, positions, "model.yaml", bad_values=bad)  # the files exist only on the nodes
    assert str(spec.image_dir) == "/var/lib/vsnap/images/llama-8b"


def test_the_deployment_restores_the_captured_and_prepulled_image_on_the_probed_port() -> None:
    docs = by_kind()
    serve, job, daemonset = docs["Deployment/llama-8b"], docs["Job/vsnap-capture-llama-8b"], docs["DaemonSet/vsnap-prepull"]
    image = model_spec()["image"]
    argv = shlex.split(container(serve, "server")["args"][0])
    assert argv[:4] == ["exec", "vsnap", "serve", "/etc/vsnap/model.yaml"]  # the spec whose image is `image`
    assert mounts(serve, "server")["/etc/vsnap"][1] == {"configMap": {"name": "vsnap-model-llama-8b"}}
    port = int(argv[argv.index("--port") + 1])
    ports = {p["name"]: p["containerPort"] for p in container(serve, "server")["ports"]}
    assert ports == {"http": port} and argv[argv.index("--host") + 1] == "0.0.0.0"
    for probe in ("startupProbe", "livenessProbe"):
        assert container(serve, "server")[probe]["httpGet"] == {"path": "/health", "port": "http"}
    # ready once the first request is fast: the file `vsnap serve --ready-file` writes then
    ready_file = argv[argv.index("--ready-file") + 1]
    assert container(serve, "server")["readinessProbe"]["exec"] == {"command": ["test", "-f", ready_file]}
    service = docs["Service/llama-8b"]["spec"]
    assert service["selector"] == serve["spec"]["template"]["metadata"]["labels"]
    assert service["ports"][0]["targetPort"] == "http"
    assert container(job, "capture")["args"][0].split()[-2:] == ["/etc/vsnap/model.yaml", "--force"]
    push = container(job, "push")["command"]
    assert push[:3] == ["vsnap", "push", image] and push[4:] == ["--model"]  # the model's files travel too
    model_dir = model_spec()["model"]
    assert mounts(job, "push")[str(Path(model_dir).parent)][1] == mounts(serve, "server")[str(Path(model_dir).parent)][1]
    # the DaemonSet pulls that reference to that path, and the model into the directory the image
    # records, on the hostPaths the serving pods mount
    listed = {line.split()[0]: line.split()[1:] for line in docs["ConfigMap/vsnap-prepull"]["data"]["images"].splitlines()
              if line.strip() and not line.startswith("#")}
    name = Path(image).name
    assert listed[name] == [push[3], model_dir]
    script = container(daemonset, "prepull")["args"][0]
    assert 'vsnap pull "$ref" --to "/var/lib/vsnap/images/$name" ${model_dir:+--model-dir "$model_dir"}' in script
    images_volume = mounts(daemonset, "prepull")["/var/lib/vsnap/images"][1]
    assert images_volume == mounts(serve, "server")[str(Path(image).parent)][1]
    models_volume = mounts(daemonset, "prepull")[str(Path(model_dir).parent)][1]
    assert models_volume["hostPath"]["path"] == mounts(serve, "server")[str(Path(model_dir).parent)][1]["hostPath"]["path"]
    assert container(daemonset, "prepull")["image"] == container(serve, "server")["image"]


def test_the_fleet_doc_names_every_manifest_and_each_names_the_doc() -> None:
    text = FLEET_DOC.read_text()
    for path in MANIFESTS:
        assert f"deploy/kubernetes/{path.name}" in text, path.name
        assert "docs/fleet.md" in path.read_text(), path.name


def test_the_doc_quotes_the_commands_the_manifests_run() -> None:
    def words(text: str) -> str:  # YAML's folded scalars (>-) join the lines the doc shows
        return " ".join(text.split())

    text = FLEET_DOC.read_text()
    docs = by_kind()
    for script in (container(docs["Deployment/llama-8b"], "server")["args"][0],
                   container(docs["Job/vsnap-capture-llama-8b"], "capture")["args"][0],
                   ", ".join(json.dumps(a) for a in container(docs["Job/vsnap-capture-llama-8b"], "push")["command"])):
        assert words(script) in words(text), script
    prepull = container(docs["DaemonSet/vsnap-prepull"], "prepull")["args"][0]
    snippet = text.split("```sh\n", 1)[1].split("```", 1)[0]
    assert words(snippet) in words(prepull)
