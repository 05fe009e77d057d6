"""Capture a real vLLM CPU server, restore it twice at once on two ports, check the oracle over
HTTP on both, stop them, and find nothing left."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.conftest import engine_processes
from tests.vllm_cpu.conftest import ROOT, VllmImage, run_vsnap
from vsnap.host.proctree import tree_pids

pytestmark = pytest.mark.criu


def io_uring_fds(pid: int) -> int:
    count = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            count += "io_uring" in fd.readlink().name
        except OSError:
            continue
    return count


def test_the_image_holds_vllm_on_its_cpu_backend(vllm_image: VllmImage) -> None:
    manifest = vllm_image.manifest
    assert manifest.engine == "vllm" and manifest.cuda_processes == 0 and manifest.host.gpus == []
    assert manifest.host.vllm and manifest.host.vllm.startswith("0.32")
    # EngineCore and its worker share named shared memory (vLLM's message queues): saved, sparse
    assert any(name.startswith("psm_") for name in manifest.shm_files)
    shm_on_disk = sum((vllm_image.image / "shm" / n).stat().st_blocks * 512 for n in manifest.shm_files)
    shm_apparent = sum(manifest.files[f"shm/{n}"].size for n in manifest.shm_files)
    assert shm_apparent > 100 << 20 and shm_on_disk < shm_apparent // 10  # holes kept
    commands = " ".join(p["command"] for p in manifest.processes)
    assert "vsnap.engine" in commands and len(manifest.processes) >= 3  # root, EngineCore, worker
    assert "io_uring_setup blocked for the tree" in (vllm_image.image / "logs" / "engine.log").read_text()


def test_two_restores_at_once_serve_the_oracle_and_stop_cleanly(vllm_image: VllmImage) -> None:
    def restore(_: int) -> dict:
        result = run_vsnap("restore", str(vllm_image.image), "--port", "0", "--detach", "--json")
        assert result.returncode == 0, result.stderr[-3000:]
        return json.loads(result.stdout)

    with ThreadPoolExecutor(max_workers=2) as pool:
        servers = list(pool.map(restore, range(2)))
    try:
        assert servers[0]["port"] != servers[1]["port"]
        assert sorted(engine_processes(vllm_image.control_dir)) == sorted(s["pid"] for s in servers)
        for server in servers:
            check = subprocess.run([sys.executable, str(ROOT / "scripts" / "check_oracle.py"),
                                    str(vllm_image.image), server["url"], "--tolerance", "0"],
                                   capture_output=True, text=True, timeout=300)
            assert check.returncode == 0, check.stdout[-2000:] + check.stderr[-2000:]
            assert json.loads(check.stdout)["max_abs_logprob_diff"] == 0.0
            pids = tree_pids(server["pid"])
            assert len(pids) >= 3 and sum(io_uring_fds(pid) for pid in pids) == 0
    finally:
        stopped = run_vsnap("stop", str(vllm_image.image), "--json")
    assert stopped.returncode == 0, stopped.stderr
    assert engine_processes(vllm_image.control_dir) == []
    assert not any(Path(f"/dev/shm/vsnap-{s['instance']}").exists() for s in servers)
