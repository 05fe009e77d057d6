"""`vsnap bench` on the CPU engine: the real cold starts, capture and restores.

The bench works on an image of its own: the spec's image (here a real one, the session's
capture) stays byte for byte as it was, and nothing the bench made is left behind, after a
success and after a failure.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import tempfile
from pathlib import Path

import pytest

from tests.conftest import engine_processes
from tests.integration.conftest import CapturedImage, run_vsnap
from vsnap.host.instances import running_instances

pytestmark = pytest.mark.criu

KEYS = {"model", "gpu", "cold_start_to_first_token_s_median", "restore_to_first_token_s_median", "capture_s",
        "image_bytes", "phases", "floor_s", "outputs"}


def bench_spec(tmp_path: Path, image: Path, name: str = "bench") -> Path:
    """A spec whose image is an existing one (that the bench must not touch) and whose control
    directory is the test's own."""
    spec = tmp_path / f"{name}.yaml"
    spec.write_text(f"name: {name}\nengine: cpu\nimage: {image}\nsnapshot:\n"
                    f"  control_dir: {tmp_path}/control/{name}\n  timeout_s: 120\n")
    return spec


def tree_state(root: Path) -> dict[str, tuple]:
    """Every entry under ``root`` (and root): mode, size, inode, mtime and, for files, sha256."""
    state = {}
    for path in [root, *sorted(root.rglob("*"))]:
        st = os.lstat(path)
        digest = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() and not path.is_symlink() else None
        state[str(path.relative_to(root))] = (st.st_mode, st.st_size, st.st_ino, st.st_mtime_ns, digest)
    return state


def leftovers(tmp_path: Path, image: Path) -> list[str]:
    """What a bench of this spec could leave: its work directories beside the image and the control
    directory, the spec's control directory (the bench must not even create it), the old
    `<control_dir>-bench` directories."""
    found = [str(p) for p in image.parent.glob(f".{image.name}.bench-*")]
    found += [str(p) for p in (tmp_path / "control").glob("*")]  # nothing at all: .bench.bench-*, bench, bench-bench*
    found += [str(p) for p in image.parent.glob(f".{image.name}.staging-*")]
    return found


def shm_dirs_of(instances: list[str]) -> list[str]:
    return [name for name in instances if Path(f"/dev/shm/vsnap-{name}").exists()]


def bench_caches() -> set[str]:
    return {p.name for p in Path(tempfile.gettempdir()).glob("vsnap-bench-cache-*")}


def test_bench_on_its_own_image(tmp_path: Path, captured: CapturedImage) -> None:
    before = tree_state(captured.image)
    caches = bench_caches()
    out = tmp_path / "records"
    result = run_vsnap("bench", str(bench_spec(tmp_path, captured.image)), "--runs", "1", "--out", str(out), "--json",
                       timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    record = json.loads(result.stdout)
    assert KEYS <= set(record)
    assert record["gpu"] is None and record["image_bytes"] > 0 and record["floor_s"] > 0
    assert {"verify image", "criu restore", "recover", "serve"} <= set(record["phases"])
    # equal outputs: 32 prompts x 16 greedy tokens, the restored server against a cold start
    same = record["outputs"]["restored_vs_cold"]
    assert same["prompts"] == 32 and same["tokens"] == 32 * 16
    assert same["mismatched_prompts"] == 0 and same["first_mismatch_position"] is None, same
    assert same["max_logprob_diff"] == 0.0
    assert record["outputs"]["cold_vs_cold"]["mismatched_prompts"] == 0
    stem = out / f"bench-bench-{record['date']}"
    assert json.loads(stem.with_suffix(".json").read_text())["capture_s"] == record["capture_s"]
    markdown = stem.with_suffix(".md").read_text()
    assert "restore to first token" in markdown and "What fills the image" in markdown
    assert "| restore #1 vs warm cold start #1 | 0 of 32 | - | 0 |" in markdown
    assert record["weights_source"] == ["model files"] and len(record["processes"]) == 3
    assert stem.with_suffix(".png").stat().st_size > 0
    # the spec's image: untouched; the bench's: gone, with everything else it made
    assert tree_state(captured.image) == before
    assert record["work"]["removed"] is True
    assert not Path(record["work"]["image_work"]).exists() and not Path(record["work"]["control_work"]).exists()
    assert leftovers(tmp_path, captured.image) == []
    # two cold starts, a restore, a standby (activated): each gone with its /dev/shm directory
    assert len(record["work"]["instances"]) == 4 and shm_dirs_of(record["work"]["instances"]) == []
    standby = record["standby"]
    assert len(standby["activation_to_first_token_s"]) == 1 and standby["standby_host_memory_bytes"][0] > 10 << 20
    assert {"verify image", "recover", "serve"} <= set(standby["phases"]) and "criu restore" not in standby["phases"]
    assert "activation to first token (median of 1)" in markdown
    assert bench_caches() <= caches
    assert engine_processes(Path(record["work"]["control_work"])) == []
    assert engine_processes(tmp_path / "control") == []


def test_bench_releases_everything_when_it_fails(tmp_path: Path, captured: CapturedImage,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A restore that fails after its server came up: the error propagates, the server, the trees,
    the bench image and directories are gone, and the logs are kept beside the record."""
    from vsnap.ops.bench import run as _bench
    from vsnap.protocol.errors import EngineError
    from vsnap.spec.schema import load_spec

    made: list[dict] = []
    real_run_cli, real_first_token = _bench.run_cli, _bench.first_token

    def run_cli(args: list[str], started: list[str]) -> dict:
        doc = real_run_cli(args, started)
        if args[0] == "restore":
            made.append(doc)
        return doc

    def first_token(url: str, model: str) -> None:
        if made:  # the restored server's first request fails
            raise EngineError("serve", "Injected", "injected after the restore", log_path=made[-1]["engine_log"])
        real_first_token(url, model)

    monkeypatch.setattr(_bench, "run_cli", run_cli)
    monkeypatch.setattr(_bench, "first_token", first_token)
    before = tree_state(captured.image)
    out = tmp_path / "records"
    with pytest.raises(EngineError, match="injected") as failure:
        _bench.run_bench(load_spec(bench_spec(tmp_path, captured.image, "failing")), runs=1, out_dir=out)
    server = made[0]
    assert not Path(server["instance_dir"]).exists()  # stopped, and its directory went with the bench's
    assert not Path(f"/dev/shm/vsnap-{server['instance']}").exists()
    assert [r for r in running_instances() if r.id == server["instance"]] == []
    assert engine_processes(tmp_path / "control") == []  # every tree's command line names its control path
    assert tree_state(captured.image) == before
    assert leftovers(tmp_path, captured.image) == []
    kept = Path(str(failure.value.log_path))
    assert kept.parent == out / f"bench-failing-{datetime.date.today().isoformat()}-failed"
    assert kept.is_file() and kept.stat().st_size > 0
