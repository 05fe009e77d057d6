"""A fresh node: neither the image nor its model. `vsnap push --model` sends the model's files
beside the image (one blob each, shared by every image of the model); `vsnap pull --model-dir`
puts them back where the image records them, never over a file it did not write. Real CPU
captures, a real registry on loopback (Debian's docker-registry), real restores."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest

from tests.conftest import VSNAP, engine_processes
from tests.integration.conftest import run_vsnap, write_spec
from tests.integration.registry_server import DOCKER_REGISTRY, LocalRegistry
from tests.integration.test_cpu_roundtrip import assert_serves_oracle
from tests.integration.test_registry import vsnap_json
from vsnap import read_manifest, restore_image, stop_server
from vsnap.host import verified
from vsnap.ops.tree import CPU_MODEL_NAME, DEFAULT_MODEL_ROOT
from vsnap.registry.client import RegistryClient
from vsnap.registry.oci import MODEL_FILE_MEDIA_TYPE, TITLE, parse_reference

pytestmark = [pytest.mark.criu,
              pytest.mark.skipif(not os.path.exists(DOCKER_REGISTRY),
                                 reason="docker-registry is not installed (make system installs it)")]


@dataclass(frozen=True)
class Node:
    base: Path
    model: Path
    image: Path
    registry: LocalRegistry
    ref: str
    push: dict


def _model_files(model: Path) -> dict[str, bytes]:
    return {str(p.relative_to(model)): p.read_bytes() for p in sorted(model.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    """A CPU capture whose model lives in a directory of this module's own, pushed with --model."""
    base = tmp_path_factory.mktemp("fresh-node")
    model = base / "models" / "tiny"
    source = DEFAULT_MODEL_ROOT / CPU_MODEL_NAME
    if not (source / "model.safetensors").is_file():  # written by the first CPU capture of the run
        assert run_vsnap("capture", str(write_spec(base, "cpu-default")), "--json").returncode == 0
    shutil.copytree(source, model)
    (model / "extra").mkdir()
    (model / "extra" / "notes.txt").write_text("a file in a subdirectory of the model\n")
    spec = write_spec(base, "cpu-model", model=str(model))
    captured = run_vsnap("capture", str(spec), "--json")
    assert captured.returncode == 0, captured.stderr
    image = Path(json.loads(captured.stdout)["image"])
    with LocalRegistry(base / "registry") as registry:
        ref = f"{registry.address}/vsnap/cpu-model:v1"
        yield Node(base, model, image, registry, ref, vsnap_json("push", str(image), ref, "--model"))
    for pid in engine_processes(base / "control" / "cpu-model"):
        subprocess.run(["kill", "-9", str(pid)])


def test_the_model_travels_as_one_raw_blob_per_file_shared_by_the_next_push(node: Node) -> None:
    manifest = read_manifest(node.image)
    files = _model_files(node.model)
    assert set(manifest.model_files()) == set(files) and "extra/notes.txt" in files
    assert node.push["model_files"] == len(files) and node.push["model_bytes"] == sum(map(len, files.values()))
    layers = [layer for layer in oci_manifest_at(node, node.ref)["layers"] if layer["mediaType"] == MODEL_FILE_MEDIA_TYPE]
    assert {layer["annotations"][TITLE]: layer["size"] for layer in layers} == {rel: len(b) for rel, b in files.items()}
    # another tag of the same image and model: every blob is in the registry already
    again = vsnap_json("push", str(node.image), node.ref.replace(":v1", ":v2"), "--model")
    assert again["uploaded"] == 0 and again["skipped"] == again["blobs"] == len(manifest.files) + len(files)


def oci_manifest_at(node: Node, ref: str) -> dict:
    data, _ = RegistryClient(parse_reference(ref)).get_manifest(1 << 20)
    return json.loads(data)


def test_a_fresh_node_pulls_image_and_model_and_restores(node: Node) -> None:
    """The model directory and the image both gone: a pull without --model-dir says where the
    model must go and the restore refuses naming a missing model file; with --model-dir the model
    is put back (root's alone, recorded so the restore does not hash it again) and the image
    restores with its oracle."""
    manifest = read_manifest(node.image)
    files = _model_files(node.model)
    away = node.base / "away"
    away.mkdir()
    os.rename(node.model, away / "model")
    os.rename(node.image, away / "image")
    target = node.base / "pulled" / "cpu-model"
    try:
        bare = vsnap_json("pull", node.ref, "--to", str(target))
        assert bare["model_dir"] is None and bare["model_files"] == len(files) and bare["model_fetched"] == 0
        plain = subprocess.run([VSNAP, "pull", node.ref, "--to", str(node.base / "pulled" / "plain")],
                               capture_output=True, text=True, timeout=300)
        assert plain.returncode == 0 and f"its model lives in {node.model}" in " ".join(plain.stdout.split())
        refused = subprocess.run([VSNAP, "restore", str(target), "--json"], capture_output=True, text=True, timeout=120)
        assert refused.returncode == 4 and str(node.model / "model.safetensors") in refused.stdout, refused.stdout
        assert f"--model-dir {node.model}" in json.loads(refused.stdout)["hint"]
        checked = subprocess.run([VSNAP, "validate", str(target), "--json"], capture_output=True, text=True, timeout=120)
        [host] = [c for c in json.loads(checked.stdout)["checks"] if c["name"] == "host match"]
        assert not host["ok"] and f"--model-dir {node.model}" in host["error"]["hint"]  # validate says so too
        assert not node.model.exists()

        # the image is here already (the same manifest.json): only its model is pulled, no --force
        doc = vsnap_json("pull", node.ref, "--to", str(target), "--model-dir", str(node.model))
        assert doc["image_was_there"] and doc["downloaded"] == 0 and doc["bytes_received"] == 0
        assert doc["model_dir"] == str(node.model) and doc["model_fetched"] == len(files)
        assert doc["model_bytes_received"] == sum(map(len, files.values()))
        assert _model_files(node.model) == files
        for rel in files:
            st = os.stat(node.model / rel)
            assert st.st_uid == 0 and not st.st_mode & 0o022
        assert not [p for p in node.model.iterdir() if p.name.startswith(".vsnap-pull-")]
        record = verified.load_dependencies()
        assert all(str(node.model / rel) in record for rel in files)  # the first restore hashes nothing of it
        server = restore_image(target, port=0)
        try:
            assert_serves_oracle(server.url, manifest.oracle, manifest.launch.oracle_top_k)
        finally:
            stop_server(server)
        # a second node-local pull keeps the model as it is: nothing fetched
        kept = vsnap_json("pull", node.ref, "--to", str(node.base / "pulled" / "again"), "--model-dir", str(node.model))
        assert kept["model_fetched"] == 0 and kept["model_files"] == len(files)
    finally:
        for leftover in (node.model, node.image):
            if leftover.exists():
                shutil.rmtree(leftover)
        os.rename(away / "model", node.model)
        os.rename(away / "image", node.image)


def test_a_model_file_already_there_that_differs_is_never_replaced(node: Node) -> None:
    target = node.base / "pulled" / "differs"
    model = node.base / "models" / "elsewhere"
    wrong = subprocess.run([VSNAP, "pull", node.ref, "--to", str(target), "--model-dir", str(model), "--json"],
                           capture_output=True, text=True, timeout=300)
    assert wrong.returncode == 2 and f"needs its model at {node.model}" in json.loads(wrong.stdout)["message"]
    assert not model.exists() and not target.exists()

    config = node.model / "config.json"
    original = config.read_bytes()
    config.write_bytes(original + b" ")
    try:
        result = subprocess.run([VSNAP, "pull", node.ref, "--to", str(target), "--model-dir", str(node.model),
                                 "--json"], capture_output=True, text=True, timeout=300)
        doc = json.loads(result.stdout)
        assert result.returncode == 3 and f"{config} is already there" in doc["message"], doc
        assert "never replaces" in doc["hint"]
        assert config.read_bytes() == original + b" " and not target.exists()
    finally:
        config.write_bytes(original)


def test_a_model_layer_the_manifest_does_not_depend_on_is_refused_before_any_blob(node: Node) -> None:
    good = oci_manifest_at(node, node.ref)
    hostile = json.loads(json.dumps(good))
    model_layer = next(layer for layer in hostile["layers"] if layer["mediaType"] == MODEL_FILE_MEDIA_TYPE)
    model_layer["annotations"][TITLE] = "planted.py"
    RegistryClient(parse_reference(node.ref)).put_manifest(json.dumps(hostile).encode(), "planted")
    target = node.base / "pulled" / "planted"
    result = subprocess.run([VSNAP, "pull", node.ref.replace(":v1", ":planted"), "--to", str(target),
                             "--model-dir", str(node.model), "--json"], capture_output=True, text=True, timeout=120)
    doc = json.loads(result.stdout)
    assert result.returncode == 4 and "model layer planted.py is not a file of the model" in doc["message"], doc
    assert not (node.model / "planted.py").exists() and not target.exists()
