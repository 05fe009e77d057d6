"""Images that travel: a real registry on loopback (Debian's docker-registry), a real CPU capture,
pushed, pulled to another path with the local image gone, restored with the oracle passing; an
altered blob in the registry's storage, an interrupted pull, an interrupted push, a hostile
artifact, a registry that asks for a login."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest

from tests.conftest import VSNAP, engine_processes
from tests.integration.conftest import run_vsnap, write_spec
from tests.integration.registry_server import DOCKER_REGISTRY, LocalRegistry, free_port, htpasswd_line
from tests.integration.test_cpu_roundtrip import assert_serves_oracle
from vsnap import read_manifest, restore_image, stop_server
from vsnap.image.store import verify_files
from vsnap.registry.client import RegistryClient
from vsnap.registry.oci import TITLE, parse_reference

pytestmark = [pytest.mark.criu,
              pytest.mark.skipif(not os.path.exists(DOCKER_REGISTRY),
                                 reason="docker-registry is not installed (make system installs it)")]


@dataclass(frozen=True)
class Pushed:
    base: Path
    image: Path
    control_dir: Path
    registry: LocalRegistry
    ref: str                # REGISTRY/REPOSITORY:TAG
    push: dict              # the push's --json document


def vsnap_json(*args: str, env: dict[str, str] | None = None, rc: int = 0) -> dict:
    result = subprocess.run([VSNAP, *args, "--json"], capture_output=True, text=True, timeout=300,
                            env={**os.environ, **(env or {})})
    # a string, not a tuple: pytest shortens a tuple's repr in the middle, where the error's message is
    assert result.returncode == rc, f"{args} exited {result.returncode}\n{result.stdout}\n{result.stderr}"
    return json.loads(result.stdout) if result.stdout.strip() else {}


@pytest.fixture(scope="module")
def pushed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pushed]:
    """One CPU capture of this module's own (a test moves it away), pushed to a registry of its own."""
    base = tmp_path_factory.mktemp("registry")
    spec = write_spec(base, "cpu-oci")
    captured = run_vsnap("capture", str(spec), "--json")
    assert captured.returncode == 0, captured.stderr
    image = Path(json.loads(captured.stdout)["image"])
    with LocalRegistry(base / "registry") as registry:
        ref = f"{registry.address}/vsnap/cpu-oci:v1"
        push = vsnap_json("push", str(image), ref)
        yield Pushed(base, image, base / "control" / "cpu-oci", registry, ref, push)
    for pid in engine_processes(base / "control" / "cpu-oci"):
        subprocess.run(["kill", "-9", str(pid)])


def oci_manifest(pushed: Pushed) -> dict:
    client = RegistryClient(parse_reference(pushed.ref))
    data, _ = client.get_manifest(1 << 20)
    return json.loads(data)


def pulls_beside(pushed: Pushed, name: str) -> Path:
    return pushed.base / "pulled" / name


def test_push_is_vsnaps_artifact_and_a_second_push_sends_nothing(pushed: Pushed) -> None:
    manifest = read_manifest(pushed.image)
    doc = pushed.push
    assert doc["kind"] == "push" and doc["blobs"] == len(manifest.files)
    assert doc["uploaded"] + doc["skipped"] == doc["blobs"]
    assert doc["reference"] == f"{pushed.ref}@{doc['digest']}"
    # CRIU pages went compressed: far fewer bytes than the image
    assert doc["bytes_sent"] < doc["image_bytes"] // 2
    layers = {layer["annotations"][TITLE]: layer for layer in oci_manifest(pushed)["layers"]}
    assert set(layers) == set(manifest.files)
    pages = [rel for rel in layers if rel.startswith("criu/pages-") and manifest.files[rel].size > 1 << 20]
    assert pages and all(layers[rel]["mediaType"].endswith("+zstd") for rel in pages)
    again = vsnap_json("push", str(pushed.image), pushed.ref)
    assert again["uploaded"] == 0 and again["skipped"] == again["blobs"] and again["digest"] == doc["digest"]


def test_pull_to_another_path_restores_with_the_oracle(pushed: Pushed) -> None:
    manifest = read_manifest(pushed.image)
    away = pushed.base / "images" / ".moved-away"
    os.rename(pushed.image, away)  # the local image is gone while the pulled one is restored
    try:
        target = pulls_beside(pushed, "cpu-oci")
        pinned = pushed.push["reference"].split(":v1@")[0] + "@" + pushed.push["digest"]
        doc = vsnap_json("pull", pinned, "--to", str(target))
        assert doc["kind"] == "pull" and doc["digest"] == pushed.push["digest"] and doc["reused"] == 0
        assert doc["downloaded"] == doc["files"] == len(manifest.files)
        pulled = read_manifest(target)
        assert pulled == manifest
        assert target.stat().st_mode & 0o777 == 0o700
        assert all((target / rel).stat().st_mode & 0o777 == 0o600 for rel in pulled.files)
        assert sorted(p.name for p in target.parent.iterdir() if not p.name.endswith(".lock")) == \
            [".cpu-oci.origin", "cpu-oci"]
        [listed] = vsnap_json("images", str(target.parent))["images"]
        assert listed["origin"] == doc["reference"]  # where it came from, pinned by digest
        verify_files(target, pulled)  # every file hashed again, the trust model with it
        server = restore_image(target, port=0)
        try:
            assert_serves_oracle(server.url, pulled.oracle, pulled.launch.oracle_top_k)
        finally:
            stop_server(server)
        assert engine_processes(pushed.control_dir) == []
    finally:
        os.rename(away, pushed.image)


def test_an_altered_blob_in_the_registry_fails_the_pull_naming_the_file(pushed: Pushed) -> None:
    manifest = read_manifest(pushed.image)
    layers = oci_manifest(pushed)["layers"]
    layer = max(layers, key=lambda x: x["size"])
    name = layer["annotations"][TITLE]
    blob = pushed.registry.blob_path(layer["digest"])
    original = blob.read_bytes()
    blob.write_bytes(original[:100] + bytes([original[100] ^ 0xFF]) + original[101:])
    try:
        target = pulls_beside(pushed, "altered")
        result = subprocess.run([VSNAP, "pull", pushed.ref, "--to", str(target)], capture_output=True, text=True,
                                timeout=300)
        assert result.returncode == 4, result.stderr
        assert f"the blob for {name} does not match its digest" in result.stderr
        assert not os.path.lexists(target)
        assert name in manifest.files
    finally:
        blob.write_bytes(original)


def test_an_interrupted_pull_publishes_nothing_and_a_rerun_completes_it(pushed: Pushed) -> None:
    target = pulls_beside(pushed, "interrupted")
    killed = subprocess.run([VSNAP, "pull", pushed.ref, "--to", str(target), "--jobs", "2"], capture_output=True,
                            text=True, timeout=300, env={**os.environ, "VSNAP_FAILPOINT": "blob pulled"})
    assert killed.returncode == -9, killed.stderr  # SIGKILLed after its first blob, others in flight
    assert not os.path.lexists(target)
    staging = [p for p in target.parent.iterdir() if p.name.startswith(".interrupted.pull-")]
    assert len(staging) == 1 and staging[0].stat().st_mode & 0o777 == 0o700
    doc = vsnap_json("pull", pushed.ref, "--to", str(target))
    assert doc["reused"] >= 1 and doc["downloaded"] == doc["files"] - doc["reused"]
    assert not staging[0].exists()
    manifest = read_manifest(target)
    assert manifest == read_manifest(pushed.image)
    verify_files(target, manifest)
    again = vsnap_json("pull", pushed.ref, "--to", str(target), rc=4)  # an image is never replaced unasked
    assert "already exists" in again["message"] and "--force" in again["hint"]


def test_an_interrupted_push_resumes_sending_only_the_rest(pushed: Pushed) -> None:
    ref = f"{pushed.registry.address}/vsnap/resumed:v1"  # another repository: its blobs are not linked yet
    killed = subprocess.run([VSNAP, "push", str(pushed.image), ref, "--jobs", "2"], capture_output=True, text=True,
                            timeout=300, env={**os.environ, "VSNAP_FAILPOINT": "blob pushed"})
    assert killed.returncode == -9, killed.stderr
    doc = vsnap_json("push", str(pushed.image), ref)
    assert doc["skipped"] >= 1 and doc["uploaded"] >= 1 and doc["digest"] == pushed.push["digest"]


def test_a_hostile_artifact_is_refused_and_writes_nothing_outside(pushed: Pushed) -> None:
    good = oci_manifest(pushed)
    hostile = json.loads(json.dumps(good))
    hostile["layers"][0]["annotations"][TITLE] = "../../escaped"
    client = RegistryClient(parse_reference(pushed.ref))
    client.put_manifest(json.dumps(hostile).encode(), "hostile")
    target = pulls_beside(pushed, "hostile")
    result = subprocess.run([VSNAP, "pull", pushed.ref.replace(":v1", ":hostile"), "--to", str(target)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 4 and "names a path outside the image" in result.stderr, result.stderr
    assert not os.path.lexists(target) and not (pushed.base / "escaped").exists()
    other = dict(good, artifactType="application/vnd.example.other")
    client.put_manifest(json.dumps(other).encode(), "other")
    result = subprocess.run([VSNAP, "pull", pushed.ref.replace(":v1", ":other"), "--to", str(target)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 4 and "is not a vsnap image" in result.stderr, result.stderr
    # a manifest.json whose control_dir a restore would mount over /etc: refused before any payload
    config = json.loads((pushed.image / "manifest.json").read_text())
    config["control_dir"] = "/etc"
    data = json.dumps(config).encode()
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    client.upload_file(io.BytesIO(data), len(data), digest)
    client.put_manifest(json.dumps(dict(good, config={**good["config"], "digest": digest, "size": len(data)})).encode(),
                        "etc")
    result = subprocess.run([VSNAP, "pull", pushed.ref.replace(":v1", ":etc"), "--to", str(target), "--json"],
                            capture_output=True, text=True, timeout=120)
    doc = json.loads(result.stdout)
    assert result.returncode == 4 and "control_dir" in doc["message"] and "/etc" in doc["message"], doc
    assert not os.path.lexists(target)


def test_a_registry_that_asks_for_a_login_gets_the_docker_configs(tmp_path: Path) -> None:
    htpasswd = tmp_path / "htpasswd"
    htpasswd.write_text(htpasswd_line("alice", "wonder"))
    target = tmp_path / "images" / "x"
    with LocalRegistry(tmp_path / "registry", htpasswd=htpasswd) as registry:
        ref = f"{registry.address}/vsnap/none:v1"
        config = tmp_path / "docker"
        config.mkdir()
        env = {"DOCKER_CONFIG": str(config)}
        doc = vsnap_json("pull", ref, "--to", str(target), env=env, rc=3)
        assert "asks for a login" in doc["message"] and "docker login" in doc["hint"]
        auth = base64.b64encode(b"alice:wrong").decode()
        (config / "config.json").write_text(json.dumps({"auths": {registry.address: {"auth": auth}}}))
        doc = vsnap_json("pull", ref, "--to", str(target), env=env, rc=3)
        assert "refused" in doc["message"] and "401" in doc["message"]
        auth = base64.b64encode(b"alice:wonder").decode()
        (config / "config.json").write_text(json.dumps({"auths": {registry.address: {"auth": auth}}}))
        doc = vsnap_json("pull", ref, "--to", str(target), env=env, rc=4)  # logged in: the tag is not there
        assert "does not exist in the registry" in doc["message"]
    doc = vsnap_json("pull", f"127.0.0.1:{free_port()}/vsnap/none:v1", "--to", str(target), rc=3)
    assert "cannot reach registry" in doc["message"]
    assert not os.path.lexists(target)
