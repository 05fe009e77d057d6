"""ops.resources: what a capture and a restore need, against written /proc/meminfo files, model
directories and a real filesystem's free space (tests/integration/test_resources_refused.py runs
a capture and validate against a full disk)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import pytest

from tests.unit import fake_image
from vsnap.ops import resources
from vsnap.protocol.errors import HostNotReady
from vsnap.spec.schema import ModelSpec

GB = 10**9


def meminfo(tmp_path: Path, available_kib: int) -> Path:
    path = tmp_path / "meminfo"
    path.write_text(f"MemTotal:       25000000 kB\nMemFree:         1000000 kB\nMemAvailable:   {available_kib} kB\n")
    return path


def spec(tmp_path: Path, engine: str = "vllm", **serve: object) -> ModelSpec:
    return ModelSpec.model_validate({"name": "m", "engine": engine, "image": str(tmp_path / "images" / "m"),
                                     "model": str(tmp_path / "model"), "serve": serve,
                                     "snapshot": {"control_dir": str(tmp_path / "control")}})


def model(tmp_path: Path, shards: dict[str, int], index: dict[str, str] | None = None,
          config: dict[str, object] | None = None) -> Path:
    directory = tmp_path / "model"
    directory.mkdir(exist_ok=True)
    for name, size in shards.items():
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        with open(directory / name, "wb") as f:
            f.truncate(size)
    if index is not None:
        (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
    (directory / "config.json").write_text(json.dumps(config or {}))
    return directory


def test_weights_are_the_shards_the_index_names_not_other_copies(tmp_path: Path) -> None:
    directory = model(tmp_path, {"model-1.safetensors": 3000, "model-2.safetensors": 2000,
                                 "consolidated.safetensors": 5000, "original/model.safetensors": 7000},
                      index={"a": "model-1.safetensors", "b": "model-2.safetensors", "c": "model-1.safetensors"})
    assert resources.weights_bytes(directory) == 5000
    (directory / "model.safetensors.index.json").unlink()
    assert resources.weights_bytes(directory) == 10000  # every top-level file, none below
    (directory / "link.safetensors").symlink_to(directory / "consolidated.safetensors")
    assert resources.weights_bytes(directory) == 10000  # a second name of one file counts once
    blobs = tmp_path / "blobs"  # a Hugging Face snapshot: every file a link into blobs/
    blobs.mkdir()
    hub = tmp_path / "snapshot"
    hub.mkdir()
    for name, size in (("a", 700), ("b", 300)):
        with open(blobs / name, "wb") as f:
            f.truncate(size)
        (hub / f"model-{name}.safetensors").symlink_to(blobs / name)
    assert resources.weights_bytes(hub) == 1000
    assert resources.weights_bytes(None) == 0


def test_fp8_at_load_halves_the_weights_only_for_an_unquantized_checkpoint(tmp_path: Path) -> None:
    directory = model(tmp_path, {"model.safetensors": 1000})
    assert resources.quantized_at_load(spec(tmp_path, quantization="fp8"), directory)
    assert not resources.quantized_at_load(spec(tmp_path), directory)
    (directory / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "fp8"}}))
    assert not resources.quantized_at_load(spec(tmp_path, quantization="fp8"), directory)


def test_a_gpu_capture_needs_disk_for_the_weights_file_and_room_on_the_gpu(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(resources, "vllm_device", lambda: "cuda")
    directory = model(tmp_path, {"model.safetensors": 16 * GB})
    h200 = {"index": 0, "name": "NVIDIA H200", "memory_bytes": 150 * GB}
    needs = {n.resource: n for n in resources.capture_needs(spec(tmp_path, gpu_memory_utilization=0.1),
                                                            directory, tmp_path / "img", [h200],
                                                            meminfo(tmp_path, 24_000_000))}
    assert needs["disk"].need == 16 * GB + resources.TREE_FLOOR["vllm-cuda"]
    assert needs["host memory"].need == resources.TREE_FLOOR["vllm-cuda"] and needs["host memory"].ok
    gpu = needs["GPU memory"]
    assert (gpu.need, gpu.have, gpu.ok) == (16 * GB, 15 * GB, False)
    with pytest.raises(HostNotReady) as refused:
        resources.require(list(needs.values()), "capture")
    assert refused.value.message.startswith("not enough GPU memory to capture: 16.0 GB needed (the model's weights)")
    assert "gpu_memory_utilization 0.1 of GPU 0 (NVIDIA H200)" in refused.value.message
    # per rank with tensor parallelism (spelled as vLLM's flags are, too), halved by FP8 at load, on
    # the GPU and in the weights file
    needs = resources.capture_needs(spec(tmp_path, **{"gpu-memory-utilization": 0.1, "tensor-parallel-size": 2,
                                                      "quantization": "fp8"}),
                                    directory, tmp_path / "img", [h200, h200], meminfo(tmp_path, 24_000_000))
    assert [n.need for n in needs if n.resource == "GPU memory"] == [4 * GB, 4 * GB]
    assert all(n.ok for n in needs if n.resource == "GPU memory")
    assert [n.need for n in needs if n.resource == "disk"] == [8 * GB + resources.TREE_FLOOR["vllm-cuda"]]
    # a float32 checkpoint is loaded in 16 bits unless the spec asks for float32
    (directory / "config.json").write_text(json.dumps({"torch_dtype": "float32"}))
    assert resources.loaded_share(spec(tmp_path), directory) == 0.5
    assert resources.loaded_share(spec(tmp_path, dtype="float32"), directory) == 1.0
    (directory / "config.json").write_text("{}")
    # weights by reference: the weights file may hold none of the model's bytes
    monkeypatch.setenv(resources.BY_REFERENCE_ENV, "1")
    needs = resources.capture_needs(spec(tmp_path), directory, tmp_path / "img", [h200], meminfo(tmp_path, 24_000_000))
    assert [n.need for n in needs if n.resource == "disk"] == [resources.TREE_FLOOR["vllm-cuda"]]
    monkeypatch.delenv(resources.BY_REFERENCE_ENV)
    reloading = ModelSpec.model_validate({**spec(tmp_path).model_dump(mode="json"), "snapshot": {
        "control_dir": str(tmp_path / "control"), "weights": "model"}})
    needs = resources.capture_needs(reloading, directory, tmp_path / "img", [h200], meminfo(tmp_path, 24_000_000))
    assert [n.need for n in needs if n.resource == "disk"] == [resources.TREE_FLOOR["vllm-cuda"]]


def test_a_cpu_capture_holds_the_weights_in_memory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(resources, "vllm_device", lambda: "cpu")
    directory = model(tmp_path, {"model.safetensors": 2 * GB})
    needs = {n.resource: n for n in resources.capture_needs(spec(tmp_path), directory, tmp_path / "img", [],
                                                            meminfo(tmp_path, 1_000_000))}
    assert needs["host memory"].need == 2 * GB + resources.TREE_FLOOR["vllm-cpu"]
    assert not needs["host memory"].ok and "GPU memory" not in needs
    with pytest.raises(HostNotReady, match="not enough host memory to capture: 3.1 GB needed"):
        resources.require(list(needs.values()), "capture")


def test_disk_is_measured_on_the_nearest_existing_directory(tmp_path: Path) -> None:
    free, where = resources.free_disk(tmp_path / "not" / "yet" / "there")
    assert where == tmp_path and free > 0


def test_a_restore_needs_the_trees_memory_at_the_dump(tmp_path: Path) -> None:
    manifest = fake_image.manifest(processes=[{"pid": 1, "command": "a", "anonymous_bytes": 3 * GB},
                                              {"pid": 2, "command": "b", "anonymous_bytes": 1 * GB}])
    (need,) = resources.restore_needs(manifest, meminfo(tmp_path, 3_000_000))
    assert (need.need, need.ok) == (4 * GB, False)
    with pytest.raises(HostNotReady) as refused:
        resources.require([need], "restore")
    assert refused.value.message == ("not enough host memory to restore: 4.0 GB needed (the tree's memory at the "
                                     "dump, 2 processes), 3.1 GB available on this host")
    assert resources.restore_needs(manifest, meminfo(tmp_path, 5_000_000))[0].ok


def test_a_meminfo_without_memavailable_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "meminfo"
    path.write_text("MemTotal: 1 kB\n")
    with pytest.raises(HostNotReady, match="no MemAvailable"):
        resources.mem_available(path)


# --- hostile model directories and manifests (hostile pass h1) ---------------------------------

class Blocked(Exception):
    """Raised by a test's alarm: a read that would have blocked forever."""


@pytest.fixture
def bounded() -> Iterator[None]:
    """A test that would block forever fails after 5 s instead."""
    import signal

    def alarm(*_: object) -> None:
        raise Blocked("blocked for 5 s")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(5)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_a_fifo_or_a_device_named_like_the_models_json_is_refused_not_read(tmp_path: Path, bounded: None) -> None:
    """A FIFO named model.safetensors.index.json blocked validate and capture's preflight forever;
    a root's link to /dev/kmsg or /proc/kcore (the trust model passes both) would read without end."""
    import os

    from vsnap.protocol.errors import ImageUntrusted

    directory = model(tmp_path, {"model.safetensors": 1000})
    os.mkfifo(directory / "model.safetensors.index.json")
    with pytest.raises(ImageUntrusted, match="not a regular file .a FIFO or a device"):
        resources.weights_bytes(directory)
    (directory / "model.safetensors.index.json").unlink()
    (directory / "model.safetensors.index.json").symlink_to("/dev/zero")
    with pytest.raises(ImageUntrusted, match="not a regular file"):
        resources.weights_bytes(directory)
    (directory / "model.safetensors.index.json").unlink()
    (directory / "config.json").unlink()
    os.mkfifo(directory / "config.json")  # (the spec refuses it; a race could put it there after)
    with pytest.raises(ImageUntrusted, match="not a regular file"):
        resources.loaded_share(spec(tmp_path), directory)


def test_another_users_link_named_like_the_models_json_is_not_followed(tmp_path: Path) -> None:
    """validate reads the model's JSON even where its trust row failed: a link of another user's
    there (to a device whose opening acts, or to a file root may read and they may not) is refused,
    not opened."""
    import os

    from vsnap.protocol.errors import ImageUntrusted

    directory = model(tmp_path, {"model.safetensors": 1000})
    secret = tmp_path / "secret.json"
    secret.write_text('{"weight_map": {"a": "model.safetensors"}}')
    link = directory / "model.safetensors.index.json"
    link.symlink_to(secret)
    os.lchown(link, 65534, 65534)
    with pytest.raises(ImageUntrusted, match="symlink .* owned by uid 65534"):
        resources.weights_bytes(directory)
    os.lchown(link, 0, 0)  # root's own link: followed
    assert resources.weights_bytes(directory) == 1000


def test_a_giant_or_deep_model_json_is_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from vsnap.protocol.errors import ImageUntrusted

    directory = model(tmp_path, {"model.safetensors": 1000})
    monkeypatch.setattr(resources, "MAX_MODEL_JSON_BYTES", 1 << 10)
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "x" * 2000}}))
    with pytest.raises(ImageUntrusted, match="has 2.* bytes, over the 0 MiB"):
        resources.weights_bytes(directory)
    monkeypatch.undo()
    deep = "[" * 100_000 + "]" * 100_000  # json.loads raised RecursionError: a traceback
    (directory / "model.safetensors.index.json").write_text(deep)
    assert resources.weights_bytes(directory) == 1000  # not an index: every top-level file
    (directory / "config.json").write_text(deep)
    assert resources.loaded_share(spec(tmp_path), directory) == 1.0


def test_index_names_that_are_not_plain_file_names_count_nothing(tmp_path: Path) -> None:
    directory = model(tmp_path, {"model.safetensors": 1000, "sub/model.safetensors": 5000},
                      index={"a": "x\u0000y.safetensors", "b": "../../etc/shadow", "c": "..", "d": "sub/model.safetensors",
                             "e": "model.safetensors"})
    assert resources.weights_bytes(directory) == 1000  # a NUL raised ValueError (embedded null byte): a traceback
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": 5, "b": None}}))
    assert resources.weights_bytes(directory) == 1000 + 0  # no name: every top-level file (sub/ is not at the top)
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": ["model.safetensors"]}))
    assert resources.weights_bytes(directory) == 1000


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1e999", -1, 0, 7, "x"])
def test_a_gpu_memory_utilization_vllm_refuses_is_not_a_traceback(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: object) -> None:
    monkeypatch.setattr(resources, "vllm_device", lambda: "cuda")
    directory = model(tmp_path, {"model.safetensors": 16 * GB})
    h200 = {"index": 0, "name": "NVIDIA H200", "memory_bytes": 100 * GB}
    needs = resources.capture_needs(spec(tmp_path, gpu_memory_utilization=value), directory, tmp_path / "img",
                                    [h200], meminfo(tmp_path, 24_000_000))
    (gpu,) = [n for n in needs if n.resource == "GPU memory"]
    assert gpu.have == 90 * GB and "gpu_memory_utilization 0.9 of GPU 0" in gpu.line


@pytest.mark.parametrize("value", ["nan", "inf", "1e999", -1, "x"])
def test_the_gpu_memory_a_capture_records_takes_vllms_default_for_a_share_vllm_refuses(
        tmp_path: Path, value: object) -> None:
    from types import SimpleNamespace

    from vsnap.ops.capture import gpu_memory_required

    facts = SimpleNamespace(gpus=[{"memory_bytes": 100 * GB}])  # only the GPUs are read
    assert gpu_memory_required(spec(tmp_path, gpu_memory_utilization=value), facts) == 90 * GB  # type: ignore[arg-type]
    assert gpu_memory_required(spec(tmp_path, gpu_memory_utilization=0.5), facts) == 50 * GB  # type: ignore[arg-type]


@pytest.mark.parametrize("value", ["many", "3000000000", 1.5e9, -1, True, [1], 1 << 60])
def test_a_manifest_process_size_that_a_capture_does_not_write_is_refused(tmp_path: Path, value: object) -> None:
    from vsnap.protocol.errors import ImageError

    manifest = fake_image.manifest(processes=[{"pid": 1, "command": "a", "anonymous_bytes": value}])
    with pytest.raises(ImageError, match=r"manifest.json: processes\[0\].anonymous_bytes is .*not a byte count"):
        resources.restore_needs(manifest, meminfo(tmp_path, 3_000_000))
    for fine in ({"pid": 1}, {"pid": 1, "anonymous_bytes": None}):
        assert resources.restore_needs(fake_image.manifest(processes=[fine]), meminfo(tmp_path, 1))[0].need == 0


def test_another_users_link_to_a_device_is_refused_as_theirs_never_statted_through(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The model's JSON behind a link of another user's to a device: refused for the link, without
    a stat through it (a stat follows the link: an automount or a FUSE mount of theirs behind it can
    hang or act), and a file swapped after the check is never opened (the checked file is the one read)."""
    import os

    from vsnap.protocol.errors import ImageUntrusted

    directory = model(tmp_path, {"model.safetensors": 1000})
    link = directory / "model.safetensors.index.json"
    link.symlink_to("/dev/null")
    os.lchown(link, 65534, 65534)
    followed: list[str] = []
    real_stat = os.stat

    def stat(path: object, *args: object, **kwargs: object) -> os.stat_result:
        if str(path) == str(link) and kwargs.get("follow_symlinks", True):
            followed.append(str(path))
        return real_stat(path, *args, **kwargs)  # type: ignore[arg-type]
    monkeypatch.setattr(os, "stat", stat)
    with pytest.raises(ImageUntrusted, match="symlink .* owned by uid 65534"):
        resources.weights_bytes(directory)
    assert followed == []
