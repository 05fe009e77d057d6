"""The real vLLM engine on a GPU: capture, restore, oracle over HTTP (the GPU machine only).

On the GPU machine, scripts/gpu-e2e.sh runs the same flow through the CLI and writes a record;
this test is for a GPU host with vLLM and pytest installed: VSNAP_TEST_MODEL=/path/to/llama.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.criu]

if shutil.which("nvidia-smi") is None or not os.environ.get("VSNAP_TEST_MODEL"):
    pytest.skip("needs an NVIDIA GPU and VSNAP_TEST_MODEL (a Llama directory); see scripts/gpu-e2e.sh",
                allow_module_level=True)


def test_vllm_capture_restore_serves_the_oracle(tmp_path: Path) -> None:
    from vsnap import capture_image, load_spec, restore_image, stop_server

    spec_path = tmp_path / "m.yaml"
    spec_path.write_text(
        f"name: gpu-test\nengine: vllm\nmodel: {os.environ['VSNAP_TEST_MODEL']}\nimage: {tmp_path}/images/m\n"
        f"serve:\n  max_model_len: 1024\n  gpu_memory_utilization: 0.3\n"
        f"snapshot:\n  control_dir: {tmp_path}/control\noracle:\n  tolerance: 0.001\n")
    captured = capture_image(load_spec(spec_path))
    assert captured.manifest.cuda_processes >= 1
    assert (captured.image_dir / "weights" / "rank0.bin").stat().st_size > 0
    server = restore_image(captured.image_dir, port=0)
    try:
        assert server.weights_source == "image weights file"
        assert server.recovery["weights_bytes"] == (captured.image_dir / "weights" / "rank0.bin").stat().st_size
        script = Path(__file__).resolve().parents[2] / "scripts" / "check_oracle.py"
        out = subprocess.run([sys.executable, str(script), str(captured.image_dir), server.url],
                             capture_output=True, text=True)
        assert out.returncode == 0, out.stdout + out.stderr
        assert json.loads(out.stdout)["ok"] is True
    finally:
        stop_server(server)
