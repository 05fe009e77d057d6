"""The GPUs' free memory and each process's share, from NVML through a fake pynvml (nvidia-ml-py
is optional: vsnap runs where it, or the driver, is missing, and then knows neither)."""

from __future__ import annotations

import sys
from types import SimpleNamespace
from typing import Any, Callable

import pytest

from vsnap.host import cuda as _cuda


class NVMLError(Exception):
    pass


class NVMLLibraryMismatchError(Exception):  # not an NVMLError, as in nvidia-ml-py
    pass


def fake_pynvml(gpus: list[dict], *, init_fails: bool = False, fail: str | None = None) -> SimpleNamespace:
    """A pynvml over ``gpus`` ({"uuid", "free", "processes": [(pid, bytes or None)]}); ``fail``
    names a call that raises NVMLError. ``calls`` records init and shutdown."""
    calls: list[str] = []

    def call(name: str, result: Callable[..., Any]) -> Callable[..., Any]:
        def function(*args: Any) -> Any:
            if name == fail:
                raise NVMLError(f"{name} failed")
            return result(*args)
        return function

    def init() -> None:
        calls.append("init")
        if init_fails:
            raise NVMLError("Driver Not Loaded")

    return SimpleNamespace(
        calls=calls, NVMLError=NVMLError, NVMLLibraryMismatchError=NVMLLibraryMismatchError,
        nvmlInit=init, nvmlShutdown=lambda: calls.append("shutdown"),
        nvmlDeviceGetCount=call("nvmlDeviceGetCount", lambda: len(gpus)),
        nvmlDeviceGetHandleByIndex=call("nvmlDeviceGetHandleByIndex", lambda i: gpus[i]),
        nvmlDeviceGetUUID=call("nvmlDeviceGetUUID", lambda gpu: gpu["uuid"]),
        nvmlDeviceGetMemoryInfo=call("nvmlDeviceGetMemoryInfo",
                                     lambda gpu: SimpleNamespace(total=100 << 30, free=gpu["free"], used=0)),
        nvmlDeviceGetComputeRunningProcesses=call(
            "nvmlDeviceGetComputeRunningProcesses",
            lambda gpu: [SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in gpu["processes"]]))


GPUS = [{"uuid": "GPU-a", "free": 1024 << 20, "processes": [(11, 512 << 20), (12, 100 << 20)]},
        {"uuid": b"GPU-b", "free": 7, "processes": [(11, 256 << 20), (13, None)]}]


def test_free_memory_and_each_processs_share_come_from_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    """UUIDs as text (older nvidia-ml-py returned bytes), memory in bytes; a process on
    two GPUs counts both; one whose share NVML does not know (None) is left out."""
    nvml = fake_pynvml(GPUS)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    assert _cuda.gpu_free_memory() == {"GPU-a": 1024 << 20, "GPU-b": 7}
    assert _cuda.gpu_memory_by_pid() == {11: 768 << 20, 12: 100 << 20}
    assert nvml.calls == ["init", "shutdown"] * 2


def test_without_pynvml_or_a_driver_nothing_is_known(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed: import raises ImportError
    assert _cuda.gpu_free_memory() == {} and _cuda.gpu_memory_by_pid() == {}
    nvml = fake_pynvml(GPUS, init_fails=True)  # installed, but no NVIDIA driver (a CPU host, CI)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    assert _cuda.gpu_free_memory() == {} and _cuda.gpu_memory_by_pid() == {}
    assert nvml.calls == ["init", "init"]  # never shut down what did not start


@pytest.mark.parametrize("fail", ["nvmlDeviceGetCount", "nvmlDeviceGetUUID", "nvmlDeviceGetMemoryInfo"])
def test_a_call_that_fails_on_every_gpu_leaves_nothing_known(monkeypatch: pytest.MonkeyPatch, fail: str) -> None:
    nvml = fake_pynvml(GPUS, fail=fail)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    assert _cuda.gpu_free_memory() == {}
    assert nvml.calls == ["init", "shutdown"]


def test_a_driver_without_the_process_call_gives_no_shares(monkeypatch: pytest.MonkeyPatch) -> None:
    """nvidia-ml-py raises its mismatch error (not an NVMLError) for a call this driver lacks."""
    nvml = fake_pynvml(GPUS)

    def mismatch(gpu: dict) -> list:
        raise NVMLLibraryMismatchError("Unversioned function called")

    nvml.nvmlDeviceGetComputeRunningProcesses = mismatch
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    assert _cuda.gpu_memory_by_pid() == {}
    assert _cuda.gpu_free_memory() == {"GPU-a": 1024 << 20, "GPU-b": 7}


def test_a_gpu_whose_call_fails_is_left_out_and_the_others_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    """A MIG GPU does not list its processes (NOT_SUPPORTED): the other GPUs' shares still count,
    as nvidia-smi's rows did."""
    nvml = fake_pynvml(GPUS)

    def processes(gpu: dict) -> list:
        if gpu["uuid"] == b"GPU-b":
            raise NVMLError("Not Supported")
        return [SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in gpu["processes"]]

    nvml.nvmlDeviceGetComputeRunningProcesses = processes
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    assert _cuda.gpu_memory_by_pid() == {11: 512 << 20, 12: 100 << 20}


def test_without_nvidia_ml_py_the_copy_inside_vllm_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM 0.26 keeps its own pynvml (vllm.third_party.pynvml): an install without vsnap's
    [vllm] extra still reads the GPUs' free memory."""
    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(__path__=[]))
    monkeypatch.setitem(sys.modules, "vllm.third_party", SimpleNamespace(__path__=[]))
    monkeypatch.setitem(sys.modules, "vllm.third_party.pynvml", fake_pynvml(GPUS))
    assert _cuda.gpu_free_memory() == {"GPU-a": 1024 << 20, "GPU-b": 7}
