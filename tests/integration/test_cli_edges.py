"""The installed `vsnap` binary at its edges: hostile specs end at once with one line and exit 2,
usage errors honour --json, `stop` exits with its own codes. Nothing here needs root or CRIU,
and nothing writes outside tmp_path (the instance registry is a temporary one)."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import time
from pathlib import Path

from tests.conftest import VSNAP

LAUGHS = "name: &a lol\nengine: cpu\nserve:\n" + "".join(
    f"  {c}: &{c} [{', '.join(['*' + p] * 9)}]\n" for p, c in zip("abcdefghi", "bcdefghij"))


def vsnap(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([VSNAP, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def test_billion_laughs_ends_at_once_in_bounded_memory(tmp_path: Path) -> None:
    spec = tmp_path / "laughs.yaml"
    spec.write_text(LAUGHS)
    start = time.monotonic()
    result = subprocess.run([VSNAP, "validate", str(spec)], capture_output=True, text=True, timeout=60,
                            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30)))
    assert time.monotonic() - start < 10  # was 45 s and 4 GB, then a MemoryError traceback
    assert result.returncode == 2, result.stderr
    assert [line for line in result.stderr.splitlines() if line.startswith("error:")] == [
        f"error: {spec}:1:7 YAML anchors (&a) are not allowed in a model.yaml; write the value out where it is used"]
    assert "Traceback" not in result.stderr


def test_hostile_specs_exit_2_without_traceback(tmp_path: Path) -> None:
    cases = {
        "deep.yaml": "name: a\nengine: cpu\nserve:\n  x: " + "[" * 5000 + "]" * 5000 + "\n",
        "digits.yaml": "name: a\nengine: cpu\noracle:\n  top_k: " + "9" * 5000 + "\n",
        "tag.yaml": "name: !foo a\nengine: cpu\n",
        "nul.yaml": "name: a\x00\nengine: cpu\n",
        "markup.yaml": 'name: a\nengine: cpu\n"[/]": 1\n',
        "system.yaml": "name: a\nengine: cpu\nimage: /var/lib\nsnapshot:\n  control_dir: /etc/vsnap\n",
    }
    for name, text in cases.items():
        (tmp_path / name).write_text(text)
        result = vsnap("validate", str(tmp_path / name))
        assert result.returncode == 2, (name, result.stderr)
        assert "Traceback" not in result.stderr and f"error: {tmp_path / name}:" in result.stderr, name
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    result = vsnap("validate", str(fifo), timeout=20)  # reading it would block forever
    assert result.returncode == 2 and "is not a regular file" in result.stderr


def test_usage_error_with_json_and_version() -> None:
    result = vsnap("ps", "--bogus", "--json")
    assert result.returncode == 2
    doc = json.loads(result.stdout)
    assert doc["kind"] == "error" and doc["error"] == "UsageError" and "--bogus" in doc["message"]
    result = vsnap("--version")
    assert result.returncode == 0 and result.stdout.startswith("vsnap ")


def test_stop_exit_codes(tmp_path: Path) -> None:
    env = {"VSNAP_RUNTIME_DIR": str(tmp_path / "run")}  # an empty registry: nothing runs
    result = vsnap("stop", "r-00000000", env=env)
    assert result.returncode == 9 and "no vsnap instance is running" in result.stderr
    result = vsnap("stop", "r-00000000", "--json", env=env)
    assert result.returncode == 9 and json.loads(result.stdout)["error"] == "NothingRunning"


def test_a_spec_inside_an_image_is_refused_before_anything_is_made(tmp_path: Path) -> None:
    """Hostile pass 18: `image:` or `snapshot.control_dir` inside an existing image validated, and the
    capture wrote into that image (which every restore and vsnap rm then refused). validate shows
    the failing row, capture refuses in its preflight, and the image is as it was."""
    from tests.unit.fake_image import make_image

    root = tmp_path / "images"
    root.mkdir(mode=0o700)
    os.chmod(tmp_path, 0o700)
    victim = make_image(root / "victim")
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    specs = {"image": f"image: {victim}/sub\nsnapshot:\n  control_dir: {tmp_path}/ctl\n",
             "control": f"image: {root}/new/fine\nsnapshot:\n  control_dir: {victim}/logs\n"}  # new/: not made
    for what, lines in specs.items():
        spec = tmp_path.parent / f"{tmp_path.name}-{what}.yaml"  # beside tmp_path: its listing stays as it was
        spec.write_text(f"name: a\nengine: cpu\n{lines}")
        result = vsnap("validate", str(spec), "--json")
        assert result.returncode != 0, result.stdout
        assert f"is inside the vsnap image {victim}" in result.stdout, result.stdout
        if os.geteuid() == 0:  # a capture's preflight runs as root only
            result = vsnap("capture", str(spec))
            assert result.returncode != 0 and f"is inside the vsnap image {victim}" in result.stderr, result.stderr
            assert "Traceback" not in result.stderr
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before
