"""Images that travel, on the real thing (CRIU, the CPU engine, one capture for the module):
`vsnap images` and `vsnap rm` on real images, and a restore on "another host" (a copy whose
manifest claims another kernel, other library versions, a changed dependency): every fatal
difference is named on its own line before anything runs; a kernel alone is a warning."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from tests.conftest import engine_processes
from tests.integration.conftest import CapturedImage, run_vsnap
from vsnap.host import verified
from vsnap.image.manifest import MANIFEST

pytestmark = pytest.mark.criu


def copy_image(captured: CapturedImage, parent: Path, name: str, **host: object) -> Path:
    """A copy of the captured image (a new directory of root's), its manifest's host facts changed.
    The manifest is not among the digested files: rewriting it needs no re-signing."""
    parent.mkdir(mode=0o700, exist_ok=True)
    image = parent / name
    shutil.copytree(captured.image, image, symlinks=True)
    if host:
        manifest = json.loads((image / MANIFEST).read_text())
        manifest["host"].update(host)
        (image / MANIFEST).write_text(json.dumps(manifest))
        os.chmod(image / MANIFEST, 0o600)
    return image


def instances_of(captured: CapturedImage) -> set[str]:
    return {p.name for p in Path(f"{captured.control_dir}.instances").iterdir()}


def test_capture_remembers_the_dependencies_it_hashed(captured: CapturedImage) -> None:
    known = verified.load_dependencies()
    for dep in captured.manifest.dependencies:
        assert (known[dep.path].sha256 if dep.path in known else None) == dep.sha256, dep.path


def test_another_kernel_and_other_libraries_are_refused_each_on_its_line(captured: CapturedImage,
                                                                        tmp_path: Path) -> None:
    torch = captured.manifest.host.torch
    image = copy_image(captured, tmp_path / "images", "elsewhere", kernel="5.15.0-91-generic", torch="2.3.1+cpu",
                       python="3.10.12", packages={"numpy": "1.26.4", "safetensors": "0.3.0"})
    manifest = json.loads((image / MANIFEST).read_text())
    changed = next(d for d in manifest["dependencies"] if d["path"].endswith("model.safetensors"))
    changed["sha256"] = "0" * 64  # the other host's model file: same size, other bytes
    (image / MANIFEST).write_text(json.dumps(manifest))
    before = instances_of(captured)
    result = run_vsnap("restore", str(image), "--port", "0")
    assert result.returncode == 4, result.stderr
    assert "Traceback" not in result.stderr
    errors = result.stderr.split("error: ", 1)[1].splitlines()
    assert errors[0] == "image does not fit this host in 5 facts:"
    import numpy
    import safetensors

    assert errors[1:6] == [
        f"  python: image has '3.10.12', host has '{captured.manifest.host.python}'",
        f"  torch: image has '2.3.1+cpu', host has '{torch}'",
        f"  package numpy: image has '1.26.4', host has '{numpy.__version__}'",
        f"  package safetensors: image has '0.3.0', host has '{safetensors.__version__}'",
        f"  file {changed['path']}: image has 'sha256 000000000000', host has 'sha256 {changed_sha(changed)}'",
    ]
    assert errors[6].startswith("hint: restore on a host with the same software")
    assert engine_processes(captured.control_dir) == []
    assert instances_of(captured) == before  # refused in verification: no instance, CRIU never ran
    checked = run_vsnap("validate", str(image), "--json")
    assert checked.returncode == 4
    checks = {c["name"]: c for c in json.loads(checked.stdout)["checks"]}
    assert checks["host match"]["ok"] is False
    assert [m["fact"] for m in checks["host match"]["error"]["mismatches"]] == [
        "python", "torch", "package numpy", "package safetensors", f"file {changed['path']}"]
    assert checks["host kernel"]["ok"] is True and checks["host kernel"]["warning"] is True


def changed_sha(dep: dict) -> str:
    from vsnap.image.store import sha256_file

    return sha256_file(Path(dep["path"]))[:12]


def test_a_kernel_alone_is_a_warning_and_rm_waits_for_the_instance(captured: CapturedImage, tmp_path: Path) -> None:
    """The restore goes on (with the warning), `vsnap images` shows the instance, `vsnap rm` is
    refused until it stops, then removes the copy and nothing else."""
    root = tmp_path / "images"
    image = copy_image(captured, root, "other-kernel", kernel="5.15.0-91-generic")
    (root / "notes.txt").write_text("not an image")
    (root / "link").symlink_to(captured.image)
    result = run_vsnap("restore", str(image), "--port", "0", "--detach")
    assert result.returncode == 0, result.stderr
    assert "warning: kernel: image has '5.15.0-91-generic', host has" in result.stderr
    instance = result.stdout.split("instance ", 1)[1].split()[0]
    try:
        listed = json.loads(run_vsnap("images", str(root), "--json").stdout)
        assert [(i["name"], i["engine"], i["origin"], i["instances"]) for i in listed["images"]] == [
            ("cpu-it", "cpu", "captured", [instance])]
        assert listed["images"][0]["size_bytes"] == sum(p.stat().st_size for p in image.rglob("*") if p.is_file())
        assert [Path(s["path"]).name for s in listed["skipped"]] == ["link"]
        refused = run_vsnap("rm", str(image))
        assert refused.returncode == 4, refused.stderr
        assert f"{image} is in use: instance {instance} runs from it" in refused.stderr
        assert (image / MANIFEST).exists()
    finally:
        stopped = run_vsnap("stop", str(image))
    assert stopped.returncode == 0, stopped.stderr
    removed = run_vsnap("rm", str(image), "--json")
    assert removed.returncode == 0, removed.stderr
    doc = json.loads(removed.stdout)["removed"]
    assert doc["path"] == str(image) and doc["files"] == len(captured.manifest.files) + 1
    assert not os.path.lexists(image) and (root / "notes.txt").exists() and (root / "link").is_symlink()
    assert [p.name for p in root.iterdir() if ".rm-" in p.name] == []
    assert (captured.image / MANIFEST).exists()  # the link's target was never touched
    plain = run_vsnap("images", str(root))
    assert plain.returncode == 0 and "no vsnap image under" in plain.stderr


def test_rm_refuses_an_image_a_capture_is_writing(captured: CapturedImage, tmp_path: Path) -> None:
    from vsnap.image.store import image_lock

    image = copy_image(captured, tmp_path / "images", "locked")
    with image_lock(image):  # what a `vsnap capture --force` of this path holds from preflight to publish
        result = run_vsnap("rm", str(image))
    assert result.returncode == 4 and f"a vsnap capture is writing {image}" in result.stderr
    assert (image / MANIFEST).exists()
