"""The real thing, no GPU: capture the CPU engine with CRIU, restore it, prove it with the oracle."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import VSNAP, engine_processes
from tests.integration.conftest import CapturedImage, run_vsnap, write_spec
from vsnap import EngineError, capture_image, load_spec, restore_image, stop_server
from vsnap.host import verified
from vsnap.protocol.oracle import Oracle

pytestmark = pytest.mark.criu


def complete(url: str, prompt: str, max_tokens: int, logprobs: int) -> dict:
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "logprobs": logprobs}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.load(response)["choices"][0]


def assert_serves_oracle(url: str, oracle: Oracle, top_k: int) -> None:
    """Every oracle prompt, asked over HTTP, gives the captured tokens and exactly the captured logprobs."""
    for sample in oracle.samples:
        choice = complete(url, sample.prompt, len(sample.token_ids), top_k)
        assert choice["token_ids"] == sample.token_ids
        expected = [top[str(token)] for token, top in zip(sample.token_ids, sample.logprobs)]
        assert choice["logprobs"]["token_logprobs"] == expected
        assert [sorted(top.values()) for top in choice["logprobs"]["top_logprobs"]] == \
               [sorted(top.values()) for top in sample.logprobs]


def test_capture_publishes_complete_private_image_and_leaves_nothing(captured: CapturedImage) -> None:
    assert captured.capture_json["kind"] == "capture"
    assert engine_processes(captured.control_dir) == []
    assert captured.image.stat().st_mode & 0o777 == 0o700
    assert all((captured.image / rel).stat().st_mode & 0o777 == 0o600 for rel in captured.manifest.files)
    assert any(rel.startswith("criu/pages-") for rel in captured.manifest.files)
    # the worker's semaphore was deleted but open: CRIU saved it as a link-remap file
    assert captured.manifest.shm_files and all(f"shm/{n}" in captured.manifest.files for n in captured.manifest.shm_files)
    assert [p.name for p in captured.image.parent.iterdir() if p.name.startswith(".cpu-it.staging")] == []
    oracle = captured.manifest.oracle
    assert len(oracle.samples) == 3 and all(len(s.token_ids) == 8 for s in oracle.samples)
    weights = [d for d in captured.manifest.dependencies if d.path.endswith("model.safetensors")]
    assert len(weights) == 1 and weights[0].sha256


def test_restore_serves_the_oracle_then_again_after_stop(captured: CapturedImage) -> None:
    for _ in range(2):  # one image restores any number of times
        server = restore_image(captured.image, port=0)
        try:
            assert engine_processes(captured.control_dir) == [server.pid]
            assert server.engine_log.parent == server.instance_dir
            assert set(server.timings) == {"verify image", "prepare host", "criu restore", "recover", "serve"}
            assert_serves_oracle(server.url, captured.manifest.oracle, captured.manifest.launch.oracle_top_k)
        finally:
            stop_server(server)
        assert engine_processes(captured.control_dir) == []
        assert not Path(f"/dev/shm/vsnap-{server.instance_id}").exists()


def test_two_restores_of_one_image_serve_at_once(captured: CapturedImage) -> None:
    """Each restore binds its own instance directory at the captured control path."""
    first = restore_image(captured.image, port=0)
    try:
        second = restore_image(captured.image, port=0)
        try:
            assert first.port != second.port and first.instance_dir != second.instance_dir
            assert sorted(engine_processes(captured.control_dir)) == sorted([first.pid, second.pid])
            for server in (first, second):
                assert_serves_oracle(server.url, captured.manifest.oracle, captured.manifest.launch.oracle_top_k)
                assert server.engine_log.is_file()
            listed = json.loads(run_vsnap("ps", "--json").stdout)["instances"]
            assert {first.instance_id, second.instance_id} <= {i["id"] for i in listed}
        finally:
            stop_server(second)
        assert not second.instance_dir.exists()
        assert_serves_oracle(first.url, captured.manifest.oracle, captured.manifest.launch.oracle_top_k)
    finally:
        stop_server(first)
    assert engine_processes(captured.control_dir) == []


def test_port_in_use_refused_before_criu(captured: CapturedImage) -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = run_vsnap("restore", str(captured.image), "--port", str(port))
    assert result.returncode == 3
    assert f"cannot serve on 127.0.0.1:{port}" in result.stderr
    assert engine_processes(captured.control_dir) == []


def test_cli_foreground_restore_stops_cleanly_on_ctrl_c(captured: CapturedImage) -> None:
    process = subprocess.Popen([VSNAP, "restore", str(captured.image), "--port", "0", "--json"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        text = ""
        assert process.stdout is not None
        while True:
            line = process.stdout.readline()
            assert line, process.stderr.read() if process.stderr else "no output"
            text += line
            if line.startswith("}"):
                break
        doc = json.loads(text)
        assert doc["kind"] == "restore" and doc["detached"] is False
        sample = captured.manifest.oracle.samples[0]
        assert complete(doc["url"], sample.prompt, 8, 1)["token_ids"] == sample.token_ids
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=30) == 130
    finally:
        if process.poll() is None:
            process.kill()
    assert engine_processes(captured.control_dir) == []


def test_detach_then_stop(captured: CapturedImage) -> None:
    result = run_vsnap("restore", str(captured.image), "--port", "0", "--detach", "--json")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert engine_processes(captured.control_dir) == [doc["pid"]]
    assert doc["instance"] in run_vsnap("ps").stdout
    stopped = run_vsnap("stop", doc["instance"], "--json")
    assert stopped.returncode == 0 and json.loads(stopped.stdout)["stopped"][0]["pid"] == doc["pid"]
    assert engine_processes(captured.control_dir) == []


def test_validate_and_inspect(captured: CapturedImage) -> None:
    result = run_vsnap("validate", str(captured.image), "--json")
    assert result.returncode == 0, result.stdout
    doc = json.loads(result.stdout)
    assert doc["ok"] and {c["name"] for c in doc["checks"]} >= {"manifest", "image files", "host match", "criu"}
    result = run_vsnap("inspect", str(captured.image), "--json")
    assert json.loads(result.stdout)["manifest"]["oracle"] == captured.manifest.oracle.model_dump(mode="json")
    # what fills the image, per process of the tree (root, resource tracker, worker)
    processes = captured.manifest.processes
    assert len(processes) == 3 and all(p["anonymous_bytes"] > 0 for p in processes)
    assert sum(p["anonymous_bytes"] for p in processes) > captured.manifest.sizes["criu_bytes"] // 2
    table = run_vsnap("inspect", str(captured.image))
    assert table.returncode == 0 and "[heap]" in table.stdout and f"process {processes[0]['pid']}" in table.stdout
    model = captured.manifest.model_files()  # config.json and model.safetensors of the built-in engine's model
    assert set(model) >= {"config.json", "model.safetensors"} and f"{len(model)} of them the model's" in table.stdout
    spec_check = run_vsnap("validate", str(captured.spec))
    assert spec_check.returncode == 0 and "criu" in spec_check.stdout


def _copy(captured: CapturedImage, tmp_path: Path) -> Path:
    copy = tmp_path / "images" / "copy"
    copy.parent.mkdir(mode=0o700)
    shutil.copytree(captured.image, copy, symlinks=True)
    return copy


def _flip_byte(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.parametrize("damage", ["flip", "truncate", "symlink", "extra", "manifest"])
def test_altered_image_refused_with_its_name(captured: CapturedImage, tmp_path: Path, damage: str) -> None:
    copy = _copy(captured, tmp_path)
    pages = max((copy / "criu").glob("pages-*.img"), key=lambda p: p.stat().st_size)
    name = f"criu/{pages.name}"
    if damage == "flip":
        _flip_byte(pages)
    elif damage == "truncate":
        os.truncate(pages, pages.stat().st_size - 4096)
    elif damage == "symlink":
        other = tmp_path / "other.img"
        shutil.copy(pages, other)
        pages.unlink()
        pages.symlink_to(other)
    elif damage == "extra":
        name = "criu/extra.img"
        (copy / name).write_bytes(b"x")
    else:
        name = "manifest.json"
        (copy / name).write_text((copy / name).read_text()[:-200])
    for command in (["validate", str(copy)], ["restore", str(copy), "--port", "0"]):
        result = run_vsnap(*command)
        assert result.returncode == 4, (command, result.stdout, result.stderr)
        assert name in result.stdout + result.stderr
    assert engine_processes(captured.control_dir) == []


def test_engine_dying_before_ready_leaves_no_image_and_no_process(tmp_path: Path) -> None:
    from vsnap.engine.adapters.cpu.model import write_model

    model = write_model(tmp_path / "broken-model")
    (model / "model.safetensors").write_bytes(b"\0" * 64)  # the worker cannot load it
    spec = load_spec(write_spec(tmp_path, "dies", model=str(model)))
    before = set(Path("/dev/shm").glob("vsnap-*"))
    with pytest.raises(EngineError) as info:
        capture_image(spec)
    assert info.value.phase == "build engine"
    log = Path(info.value.log_path or "")
    assert log.name == "engine.log" and log.parent.parent == Path(f"{spec.control_dir}.instances")
    assert "weights" in log.read_text() or "safetensors" in log.read_text().lower()
    assert not spec.image_dir.exists()
    assert [p.name for p in spec.image_dir.parent.iterdir() if "staging" in p.name] == []
    assert engine_processes(spec.control_dir) == []
    assert not Path(f"/dev/shm/vsnap-{log.parent.name}").exists()  # the capture's own /dev/shm directory


def test_existing_image_needs_force(captured: CapturedImage) -> None:
    result = run_vsnap("capture", str(captured.spec))
    assert result.returncode == 4
    assert "already exists" in result.stderr and "--force" in result.stderr


def test_bad_spec_reports_line_and_key_before_anything_runs(tmp_path: Path) -> None:
    spec = tmp_path / "bad.yaml"
    spec.write_text(f"name: bad\nengine: cpu\nimage: {tmp_path}/img\noracle:\n  top_k: lots\n")
    result = run_vsnap("capture", str(spec))
    assert result.returncode == 2
    assert f"{spec}:5:3 oracle.top_k: Input should be a valid integer" in result.stderr
    missing = tmp_path / "missing.yaml"
    missing.write_text(f"name: m\nengine: cpu\nimage: {tmp_path}/img\nmodel: {tmp_path}/no-model\n")
    result = run_vsnap("capture", str(missing), "--json")
    assert result.returncode == 2
    doc = json.loads(result.stdout)
    assert doc["issues"][0]["line"] == 4 and doc["issues"][0]["field"] == "model"
    assert not (tmp_path / "img").exists()
    assert not Path("/run/vsnap/m").exists()


def test_bounded_load_on_a_restored_server(captured: CapturedImage) -> None:
    from vsnap.ops.bench.loadgen import run_load

    server = restore_image(captured.image, port=0)
    try:
        result = run_load(server.url, concurrency=4, seconds=4, max_requests=2000)
    finally:
        stop_server(server)
    assert result.errors == 0, result.error_samples
    assert result.requests >= 20
    with pytest.raises(ValueError, match="loopback addresses only"):
        run_load("http://10.0.0.1:8000", seconds=0.1)


def test_changed_host_files_are_named_and_changed_weights_fail_the_oracle(tmp_path: Path) -> None:
    """Cross-host readiness: a file the tree depends on differs. A different size, or the same size
    with other content (its sha256), is refused before CRIU runs, by validate and by restore; and
    if the manifest is made to record the changed file's digest, the restore still fails closed
    on the oracle (exit 7) without ever opening the port."""
    from vsnap.engine.adapters.cpu.model import write_model
    from vsnap.image.store import sha256_file

    model = write_model(tmp_path / "model")
    spec = write_spec(tmp_path, "deps", model=str(model))
    captured = run_vsnap("capture", str(spec), "--json")
    assert captured.returncode == 0, captured.stderr
    image = json.loads(captured.stdout)["image"]
    weights = model / "model.safetensors"
    original = weights.read_bytes()

    weights.write_bytes(original + b"\0")
    for command in (["validate", image], ["restore", image, "--port", "0"]):
        result = run_vsnap(*command)
        assert result.returncode == 4
        assert f"file {weights}: image has '{len(original)} bytes'" in result.stdout + result.stderr

    # same size, other values: the final layer norm's scale set to zero
    header_len = int.from_bytes(original[:8], "little")
    begin, end = json.loads(original[8:8 + header_len])["ln_f.weight"]["data_offsets"]
    base = 8 + header_len
    weights.write_bytes(original[:base + begin] + bytes(end - begin) + original[base + end:])
    changed = sha256_file(weights)
    for command in (["validate", image], ["restore", image, "--port", "0"]):
        result = run_vsnap(*command)
        assert result.returncode == 4, result.stderr
        assert f"file {weights}: image has 'sha256 " in result.stderr and f"host has 'sha256 {changed[:12]}'" in \
            result.stderr
    assert engine_processes(tmp_path / "control" / "deps") == []
    manifest_path = Path(image) / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    for dep in manifest["dependencies"]:
        if dep["path"] == str(weights):
            dep["sha256"] = changed  # the manifest no longer protects the weights: the oracle must
    manifest_path.write_text(json.dumps(manifest))
    os.chmod(manifest_path, 0o600)
    result = run_vsnap("restore", image, "--port", "0", "--detach")
    if result.returncode == 0:
        run_vsnap("stop", image)
    assert result.returncode == 7, result.stderr
    assert "OracleMismatch" in result.stderr or "expected" in result.stderr
    assert engine_processes(tmp_path / "control" / "deps") == []


def test_restore_hashes_only_files_not_verified_before(captured: CapturedImage) -> None:
    """Capture (and validate) seed the verification record: a restore then hashes nothing, unless
    --rehash (tests/unit/test_verified.py covers files changed in place)."""
    first = restore_image(captured.image, port=0)
    stop_server(first)
    again = restore_image(captured.image, port=0)
    stop_server(again)
    assert again.hashed_files == 0
    result = run_vsnap("restore", str(captured.image), "--port", "0", "--rehash", "--detach", "--json")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["hashed_files"] == len(captured.manifest.files) > 0
    assert run_vsnap("stop", doc["instance"], "--json").returncode == 0
    verified.forget(captured.image)  # as on a host that never saw the image: validate seeds the record
    assert run_vsnap("validate", str(captured.image), "--json").returncode == 0
    after_validate = restore_image(captured.image, port=0)
    stop_server(after_validate)
    assert after_validate.hashed_files == 0


def test_lazy_pages_restore_serves_the_oracle_and_leaves_no_server(captured: CapturedImage) -> None:
    """CRIU returns before the tree's memory is read; `criu lazy-pages` fills it on first touch."""
    server = restore_image(captured.image, port=0, lazy_pages=True)
    try:
        assert server.lazy_pages is not None
        assert (server.instance_dir / "lazy-pages.log").stat().st_size > 0
        assert_serves_oracle(server.url, captured.manifest.oracle, captured.manifest.launch.oracle_top_k)
        assert server.lazy_pages.wait(60)  # every page delivered: it ended by itself
    finally:
        stop_server(server)
    assert engine_processes(captured.control_dir) == []
    result = run_vsnap("restore", str(captured.image), "--port", "0", "--lazy-pages", "--detach", "--json")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["lazy_pages"] is True
    assert_serves_oracle(doc["url"], captured.manifest.oracle, captured.manifest.launch.oracle_top_k)
    assert run_vsnap("stop", doc["instance"], "--json").returncode == 0
    deadline = time.monotonic() + 30
    while subprocess.run(["pgrep", "-f", f"lazy-pages --images-dir {captured.image}"]).returncode == 0:
        assert time.monotonic() < deadline, "criu lazy-pages outlived the restored tree"
        time.sleep(0.1)
