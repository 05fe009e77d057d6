"""The bench's floor: which weight bytes a restore moves besides CRIU's pages, and at what bandwidth.

vLLM on CUDA streams the image's weights file (or reloads the model's safetensors) to the GPU;
the cpu engine reloads the model's safetensors; vLLM's CPU backend has its weights back inside
CRIU's pages, so nothing is counted twice and no GPU is probed.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from vsnap.ops.bench.floor import restore_floor
from vsnap.ops.bench.record import cli_phases, write_record

MB = 1_000_000


def files(tmp_path: Path, weights_file: bool) -> tuple[list[Path], Path]:
    image, model = tmp_path / "image", tmp_path / "model"
    (image / "criu").mkdir(parents=True)
    model.mkdir()
    (image / "criu" / "pages-1.img").write_bytes(b"p" * (3 * MB))
    (model / "model.safetensors").write_bytes(b"w" * (2 * MB))
    image_files = [image / "criu" / "pages-1.img"]
    if weights_file:
        (image / "weights").mkdir()
        (image / "weights" / "rank0.bin").write_bytes(b"w" * (2 * MB))
        image_files.append(image / "weights" / "rank0.bin")
    return image_files, model


def no_gpu() -> float | None:
    raise AssertionError("the host-to-device bandwidth must not be measured here")


def test_vllm_cpu_backend_weights_are_in_criu_pages(tmp_path: Path) -> None:
    image_files, model = files(tmp_path, weights_file=False)
    floor = restore_floor(image_files, 3 * MB, model, "cpu", read=lambda _: 1e6, h2d=no_gpu)
    assert floor.weight_bytes == 0 and floor.h2d_bytes_per_s is None
    assert floor.seconds == pytest.approx(3.0)  # the image alone; the model's 2 MB are not read


def test_cpu_engine_reloads_the_model_files(tmp_path: Path) -> None:
    image_files, model = files(tmp_path, weights_file=False)
    floor = restore_floor(image_files, 3 * MB, model, None, read=lambda _: 1e6, h2d=no_gpu)
    assert floor.weight_bytes == 2 * MB and floor.h2d_bytes_per_s is None
    assert floor.seconds == pytest.approx(5.0)


def test_cuda_weights_file_at_the_slower_bandwidth(tmp_path: Path) -> None:
    image_files, model = files(tmp_path, weights_file=True)
    floor = restore_floor(image_files, 5 * MB, model, "cuda", read=lambda _: 2e6, h2d=lambda: 1e6)
    assert floor.weight_bytes == 2 * MB and floor.h2d_bytes_per_s == 1e6
    assert floor.seconds == pytest.approx(3 / 2 + 2 / 1)  # CRIU's 3 MB read, the weights file copied at H2D


def test_cuda_without_weights_file_reloads_the_model(tmp_path: Path) -> None:
    image_files, model = files(tmp_path, weights_file=False)
    floor = restore_floor(image_files, 3 * MB, model, "cuda", read=lambda _: 1e6, h2d=lambda: None)
    assert floor.weight_bytes == 2 * MB and floor.seconds == pytest.approx(5.0)  # no H2D figure: read bandwidth


def record(weight_bytes: int, h2d: float | None) -> dict:
    return {"model": "m (/m)", "gpu": None, "date": "2026-12-01", "command": "vsnap bench SPEC --runs 3", "runs": 3,
            "cold_start_fully_cold_s": 60.0, "cold_start_to_first_token_s_median": 58.0,
            "restore_to_first_token_s_median": 1.2, "restore_spread_s": [1.1, 1.3], "speedup_vs_warm_cold_start": 48.3,
            "capture_s": 70.0, "floor_s": 0.4, "floor_inputs": {"image_read_bytes_per_s": 4e9, "h2d_bytes_per_s": h2d},
            "image_bytes": 1_700_000_000, "weight_bytes": weight_bytes, "weights_source": ["image memory"],
            "phases": {"criu restore": 0.9}, "processes": [], "outputs": {}}


def test_markdown_says_where_the_weights_came_from(tmp_path: Path) -> None:
    text = write_record(record(0, None), tmp_path, "cpu").read_text()
    assert "| floor (image read) | 0.40 |" in text
    assert "weights inside CRIU's pages (restored from: image memory)" in text
    text = write_record(record(16 * 10**9, 5e10), tmp_path, "gpu").read_text()
    assert "| floor (image read + weights to device) |" in text and "weights 16.00 GB read besides" in text


def test_restore_phases_are_seconds_only() -> None:
    """The engine's rate (GB/s) and the oracle's difference are not phases: a record printed
    ``weights_gb_per_s 20.46 s`` among the seconds until session 18."""
    doc = {"timings": {"criu restore": 0.48}, "cli_overhead_s": 0.2, "command_start_s": 0.19,
           "recovery": {"weights_load_s": 3.58, "weights_gb_per_s": 20.46, "oracle_max_abs_diff": 0.0,
                        "weights_bytes": 7.2e10, "verify_gpu_s": 0.06}}
    assert cli_phases(doc) == {"criu restore": 0.48, "engine weights_load_s": 3.58, "verify_gpu_s": 0.06,
                               "cli_overhead_s": 0.2, "cli_start_s": 0.19}
