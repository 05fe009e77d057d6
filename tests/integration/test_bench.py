"""`vsnap bench` on the CPU engine: the real cold starts, capture and restores, one of each."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import engine_processes
from tests.integration.conftest import run_vsnap, write_spec

pytestmark = pytest.mark.criu

KEYS = {"model", "gpu", "cold_start_to_first_token_s_median", "restore_to_first_token_s_median", "capture_s",
        "image_bytes", "phases", "floor_s"}


def test_bench_writes_its_record(tmp_path: Path) -> None:
    spec = write_spec(tmp_path, "bench")
    out = tmp_path / "records"
    result = run_vsnap("bench", str(spec), "--runs", "1", "--out", str(out), "--json")
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    assert KEYS <= set(record)
    assert record["gpu"] is None and record["image_bytes"] > 0 and record["floor_s"] > 0
    assert {"verify image", "criu restore", "recover", "serve"} <= set(record["phases"])
    stem = out / f"bench-bench-{record['date']}"
    assert json.loads(stem.with_suffix(".json").read_text())["capture_s"] == record["capture_s"]
    markdown = stem.with_suffix(".md").read_text()
    assert "restore to first token" in markdown and "What fills the image" in markdown
    assert record["weights_source"] == ["model files"] and len(record["processes"]) == 3
    assert stem.with_suffix(".png").stat().st_size > 0
    assert engine_processes(tmp_path / "control" / "bench") == []
    assert engine_processes(Path(f"{tmp_path}/control/bench-bench")) == []
