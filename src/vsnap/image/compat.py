"""The image against this host: every recorded fact that differs, fatal or a warning, and the
files the tree depends on by size and sha256 (docs/image-format.md, "Restoring on another host")."""

from __future__ import annotations

import os
import platform
import socket
import stat
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from vsnap.host import cuda as cuda_driver
from vsnap.host import verified
from vsnap.host.criu.runner import CriuRunner
from vsnap.host.facts import HostFacts, engine_packages, package_version, vllm_version
from vsnap.host.trust import untrusted_file
from vsnap.protocol.errors import ImageHostMismatch, VsnapError
from vsnap.protocol.version import __version__

from . import store
from .manifest import Dependency, Manifest


@dataclass(frozen=True)
class HostDifference:
    """One recorded fact that differs on this host. ``fatal``: a restore is refused (every fatal
    difference is named at once); otherwise it is a warning. ``why`` says what the fact changes
    (docs/image-format.md, "Restoring on another host")."""

    fact: str
    recorded: str
    current: str
    fatal: bool
    why: str

    @property
    def line(self) -> str:
        return f"{self.fact}: image has {self.recorded!r}, host has {self.current!r}"

    @property
    def triple(self) -> tuple[str, str, str]:
        return self.fact, self.recorded, self.current


WHY_ARCH = "the image's memory is this architecture's machine code"
WHY_PYTHON = "the interpreter's memory and the binary it maps are in the image"
WHY_LIBRARY = ("the image holds this library's loaded code and state; what the engine imports after the restore "
               "would come from another version")
WHY_VSNAP = ("the engine code frozen in the image is another vsnap's; the engine protocol is the same (checked), "
             "so they still speak one contract")
WHY_KERNEL = ("CRIU restores across kernels when `criu check` passes (checked); the GPU driver's kernel module "
              "is the driver check")
WHY_CRIU_OLDER = "an older CRIU may not read what a newer one wrote into the image"
WHY_CRIU_NEWER = "CRIU reads the images of older versions"
WHY_DRIVER = ("the CUDA checkpoint restores the driver's own state, and the tree maps the driver's user-space "
              "library: both must be the capturing driver's")
WHY_GPU = "the GPU memory restored by the CUDA checkpoint is laid out for the captured GPU model"
WHY_GPU_COUNT = "a tensor-parallel image restores one worker per GPU, each onto its own GPU of the captured model"
WHY_FILE = ("the restored tree maps or reads this file by path (CRIU reopens it): another file would run code "
            "or weights the image was not captured with")


def _version_tuple(text: str) -> tuple[int, ...] | None:
    parts = text.split(".")
    return tuple(int(p) for p in parts) if all(p.isdigit() for p in parts) else None


def compare_facts(recorded: HostFacts, current: HostFacts, *, engine: str, cuda: bool) -> list[HostDifference]:
    """Every recorded fact that differs on ``current`` (hostname and GPU UUIDs never count: a
    restore may run on any host, onto any GPU of the captured model)."""
    differences = []

    def differ(fact: str, was: str | None, now: str | None, fatal: bool, why: str) -> None:
        if was != now:
            differences.append(HostDifference(fact, str(was), str(now), fatal, why))

    differ("arch", recorded.arch, current.arch, True, WHY_ARCH)
    differ("python", recorded.python, current.python, True, WHY_PYTHON)
    differ("torch", recorded.torch, current.torch, True, WHY_LIBRARY)
    if engine == "vllm":
        differ("vllm", recorded.vllm, current.vllm, True, WHY_LIBRARY)
    for name, version in sorted(recorded.packages.items()):
        differ(f"package {name}", version, current.packages.get(name), True, WHY_LIBRARY)
    differ("vsnap", recorded.vsnap, current.vsnap, False, WHY_VSNAP)
    differ("kernel", recorded.kernel, current.kernel, False, WHY_KERNEL)
    if recorded.criu != current.criu and current.criu:
        was, now = _version_tuple(recorded.criu), _version_tuple(current.criu)
        older = was is None or now is None or now < was
        differ("criu", recorded.criu, current.criu, older, WHY_CRIU_OLDER if older else WHY_CRIU_NEWER)
    if cuda:
        differ("NVIDIA driver", recorded.driver, current.driver, True, WHY_DRIVER)
        differ("CUDA driver API", recorded.cuda, current.cuda, True, WHY_DRIVER)
        want = recorded.gpus[0]["name"] if recorded.gpus else None
        if want not in {g.get("name") for g in current.gpus}:
            differences.append(HostDifference("GPU model", str(want),
                                              ", ".join(str(g.get("name")) for g in current.gpus) or "none",
                                              True, WHY_GPU))
    return differences


def current_facts(manifest: Manifest, gpus: Future[tuple[str | None, str, list[dict]]] | None = None) -> HostFacts:
    """This host's facts as a restore of ``manifest`` compares them (CRIU's version is left empty
    when CRIU cannot run: the CRIU check reports that). ``gpus``: the GPUs' facts (host.cuda.gpu_facts)
    being read elsewhere, so the driver is asked once."""
    try:
        criu = ".".join(map(str, CriuRunner.locate().version()))
    except VsnapError:
        criu = ""
    packages, torch = engine_packages(manifest.engine), package_version("torch")
    vllm = vllm_version() if manifest.engine == "vllm" else None
    driver, cuda, found = None, None, []
    if manifest.engine == "vllm" and manifest.cuda_processes:  # last: the CUDA driver may still be starting

        driver, cuda, found = gpus.result() if gpus is not None else cuda_driver.gpu_facts()
    return HostFacts(hostname=socket.gethostname(), kernel=platform.release(), arch=platform.machine(), criu=criu,
                     python=platform.python_version(), torch=torch, vllm=vllm, vsnap=__version__,
                     driver=driver, cuda=cuda, gpus=found, packages=packages)


def dependency_mismatches(dependencies: list[Dependency], *, hash_files: bool, cache_root: Path | None = None,
                          rehash: bool = False) -> list[tuple[str, str, str]]:
    """Host files the tree depends on that are missing or changed.

    Sizes are always compared; contents (sha256) when ``hash_files``. With ``cache_root``, a file
    this host hashed before (at capture, `vsnap validate IMAGE`, an earlier restore) and whose
    identity did not change since is not read again unless ``rehash`` (validate), and the files
    that matched are remembered there (host.verified).
    """
    mismatches = []
    checked: set[Path] = set()
    known = verified.load_dependencies(cache_root) if cache_root is not None and not rehash else {}
    to_hash: dict[str, tuple[os.stat_result, str]] = {}
    statted_at = time.time_ns()
    for dep in dependencies:
        path = Path(dep.path)
        try:
            problem = untrusted_file(path, checked) if path.exists() else None
        except (OSError, ValueError):  # a name the kernel refuses (too long): no such file here
            mismatches.append((f"file {dep.path[:200]}", f"{dep.size} bytes", "missing"))
            continue
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
        elif hash_files and dep.sha256 is not None and not verified.dependency_verified(known, dep.path, st,
                                                                                         dep.sha256):
            to_hash[dep.path] = (st, dep.sha256)
    if to_hash:
        ordered = sorted(to_hash)
        with ThreadPoolExecutor(max_workers=store.HASH_THREADS) as pool:
            digests = dict(zip(ordered, pool.map(lambda p: store.sha256_file(Path(p)), ordered)))
        matched = {}
        for path in ordered:
            st, want = to_hash[path]
            if digests[path] != want:
                mismatches.append((f"file {path}", f"sha256 {want[:12]}", f"sha256 {digests[path][:12]}"))
            else:
                matched[path] = (st, want)
        if matched and cache_root is not None:
            verified.remember_dependencies(matched, cache_root, statted_at)
    order = {f"file {dep.path}": index for index, dep in enumerate(dependencies)}
    return sorted(mismatches, key=lambda m: order.get(m[0], len(order)))


def host_differences(manifest: Manifest, current: HostFacts | Future[HostFacts] | None = None, *,
                     hash_files: bool = False, cache_root: Path | None = None,
                     rehash: bool = False) -> list[HostDifference]:
    """Every recorded fact of ``manifest`` that differs on this host (``current``: its facts, or
    their reading under way in another thread; by default read now), fatal ones first, then
    warnings; each dependency file that is missing or changed is a fatal difference of its own
    (see dependency_mismatches)."""
    # the files first: a restore reads the facts (and checks the GPU) in other threads meanwhile
    files = [HostDifference(fact, recorded, now, True, WHY_FILE) for fact, recorded, now in
             dependency_mismatches(manifest.dependencies, hash_files=hash_files, cache_root=cache_root,
                                   rehash=rehash)]
    if isinstance(current, Future):
        current = current.result()
    current = current or current_facts(manifest)
    cuda = manifest.engine == "vllm" and bool(manifest.cuda_processes)
    differences = compare_facts(manifest.host, current, engine=manifest.engine, cuda=cuda)
    model = manifest.host.gpus[0].get("name") if manifest.host.gpus else None
    have = sum(1 for g in current.gpus if g.get("name") == model)
    if cuda and model is not None and 0 < have < manifest.tensor_parallel_size:
        differences.append(HostDifference("GPU count", f"{manifest.tensor_parallel_size} x {model}",
                                          f"{have} x {model}", True, WHY_GPU_COUNT))
    return sorted(differences + files, key=lambda d: not d.fatal)


def host_mismatches(manifest: Manifest, *, hash_files: bool = False) -> list[tuple[str, str, str]]:
    """The fatal differences as (fact, recorded, current)."""
    return [d.triple for d in host_differences(manifest, hash_files=hash_files) if d.fatal]


def require_host_matches(manifest: Manifest, current: HostFacts | Future[HostFacts] | None = None, *,
                         cache_root: Path | None = None) -> list[HostDifference]:
    """Refuse (ImageHostMismatch, every fatal difference on its own line) a host the image cannot
    be restored on; return the differences that do not stop a restore (warnings).

    Dependency files are compared by size and sha256; with ``cache_root`` only the files this host
    has not hashed since they last changed are read (host.verified)."""
    differences = host_differences(manifest, current, hash_files=True, cache_root=cache_root)
    fatal = [d for d in differences if d.fatal]
    if fatal:
        raise ImageHostMismatch([d.triple for d in fatal], hint=model_missing_hint(manifest, fatal))
    return differences


def model_missing_hint(manifest: Manifest, fatal: list[HostDifference]) -> str:
    """Where model files are missing (a fresh node): how to bring them; else the default hint."""
    model_paths = {f"file {dep.path}" for dep in manifest.model_files().values()}
    if any(d.fact in model_paths and d.current == "missing" for d in fatal):
        return (f"the image's model is not in {manifest.launch.model} on this host: put it there, or pull the image "
                f"with `vsnap pull REF --model-dir {manifest.launch.model}` (an image pushed with --model carries it)")
    return ""
