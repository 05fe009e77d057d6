"""CUDA checkpoint through the driver API (cuda-bindings): lock, checkpoint, restore, unlock.

Moves every process of the tree that holds a CUDA context (in vLLM 0.26 both the API server
and EngineCore) between the GPU and host memory, so that CRIU sees plain processes. It reads
each process's state first, remembers what it moved, and undoes a half-done step on failure.
No cuda-checkpoint binary is needed. The GPUs' free memory and each process's use of it come from
NVML through nvidia-ml-py (pynvml), optional: where it or the driver is missing they are unknown.
"""

from __future__ import annotations

import importlib
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, TypeVar

from vsnap.protocol.errors import CheckpointError, HostNotReady

LOCK_TIMEOUT_MS = 10_000
T = TypeVar("T")
INSTALL_HINT = "install cuda-bindings (pip install 'vsnap[vllm]') and an NVIDIA driver >= 550 (checkpoint API)"


class CudaCheckpointError(CheckpointError):
    def __init__(self, pid: int, call: str, result: str) -> None:
        super().__init__(f"{call} failed for pid {pid}: {result}", phase="cuda checkpoint",
                         hint="the process may hold a CUDA state the driver cannot checkpoint; see the engine log")
        self.pid, self.call, self.result = pid, call, result


def _driver() -> Any:
    try:
        from cuda.bindings import driver
    except ImportError:
        raise HostNotReady("cuda", "cuda-bindings is not installed", hint=INSTALL_HINT) from None
    (err,) = driver.cuInit(0)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise HostNotReady("cuda", f"cuInit failed: {err.name}", hint="is an NVIDIA GPU and driver present?")
    if not hasattr(driver, "cuCheckpointProcessCheckpoint"):
        raise HostNotReady("cuda", "this cuda-bindings has no checkpoint API", hint=INSTALL_HINT)
    return driver


@dataclass
class CudaCheckpoint:
    """Checkpoint and restore the CUDA state of a set of processes (host PIDs)."""

    driver: Any = field(default_factory=_driver)

    def _call(self, pid: int, name: str, *args: Any) -> Any:
        result = getattr(self.driver, name)(pid, *args)
        err = result[0] if isinstance(result, tuple) else result
        if err != self.driver.CUresult.CUDA_SUCCESS:
            raise CudaCheckpointError(pid, name, getattr(err, "name", str(err)))
        return result[1] if isinstance(result, tuple) and len(result) > 1 else None

    def state(self, pid: int) -> str | None:
        """'running', 'locked', 'checkpointed', ... or None if the process has no CUDA context."""
        result = self.driver.cuCheckpointProcessGetState(pid)
        if result[0] != self.driver.CUresult.CUDA_SUCCESS:
            return None
        return str(result[1].name).removeprefix("CU_PROCESS_STATE_").lower()

    def cuda_pids(self, pids: list[int]) -> list[int]:
        return [pid for pid in pids if self.state(pid) is not None]

    def checkpoint(self, pids: list[int]) -> None:
        """Lock every process, then checkpoint each; on failure restore and unlock what was done."""
        locked: list[int] = []
        checkpointed: list[int] = []
        try:
            lock_args = self.driver.CUcheckpointLockArgs()
            lock_args.timeoutMs = LOCK_TIMEOUT_MS
            for pid in pids:
                self._call(pid, "cuCheckpointProcessLock", lock_args)
                locked.append(pid)
            for pid in pids:
                self._call(pid, "cuCheckpointProcessCheckpoint", None)
                checkpointed.append(pid)
        except BaseException:
            for pid in checkpointed:
                self.driver.cuCheckpointProcessRestore(pid, None)
            for pid in locked:
                self.driver.cuCheckpointProcessUnlock(pid, None)
            raise

    def _restore_args(self, gpu_pairs: list[tuple[str, str]]) -> Any:
        d = self.driver
        pairs = []
        for old, new in gpu_pairs:
            pair = d.CUcheckpointGpuPair()
            for attr, text in (("oldUuid", old), ("newUuid", new)):
                uuid = d.CUuuid()
                uuid.bytes = _uuid_bytes(text)
                setattr(pair, attr, uuid)
            pairs.append(pair)
        args = d.CUcheckpointRestoreArgs()
        args.gpuPairs = pairs
        args.gpuPairsCount = len(pairs)
        return args

    def restore(self, pids: list[int], gpu_pairs: list[tuple[str, str]] | None = None) -> None:
        """Restore device memory of every checkpointed process (in parallel), then unlock them all.

        ``gpu_pairs`` maps a captured GPU's UUID to the one to restore onto (every GPU the process
        saw must appear; vsnap captures with one visible GPU).
        """
        candidates = gpu_pair_candidates(gpu_pairs) if gpu_pairs else []
        waiting = [pid for pid in pids if self.state(pid) == "checkpointed"]
        if len(waiting) > 1:  # the driver calls release the GIL: processes restore side by side
            with ThreadPoolExecutor(max_workers=len(waiting)) as pool:
                for future in [pool.submit(self._restore_one, pid, candidates) for pid in waiting]:
                    future.result()
        else:
            for pid in waiting:
                self._restore_one(pid, candidates)
        for pid in pids:
            if self.state(pid) == "locked":
                self._call(pid, "cuCheckpointProcessUnlock", None)

    def _restore_one(self, pid: int, candidates: list[list[tuple[str, str]]]) -> None:
        if not candidates:
            self._call(pid, "cuCheckpointProcessRestore", None)
            return
        errors = []
        for pairs in candidates:
            try:
                args = self._restore_args(pairs)
            except (AttributeError, TypeError, ValueError):
                args = None  # this cuda-bindings cannot build the struct: the C ABI through ctypes
            result = (_ctypes_restore(pid, pairs) if args is None
                      else int(self.driver.cuCheckpointProcessRestore(pid, args)[0]))
            if result == 0:
                return
            errors.append(f"{len(pairs)} pair(s) via {'ctypes' if args is None else 'cuda-bindings'}: CUresult {result}")
        raise CudaCheckpointError(pid, "cuCheckpointProcessRestore", "; ".join(errors))


def gpu_pair_candidates(gpu_pairs: list[tuple[str, str]]) -> list[list[tuple[str, str]]]:
    """GPU maps to try: first a permutation of every GPU of this host (the driver wants each GPU it
    sees mapped), then exactly the pairs asked for."""
    try:
        _, _, gpus = gpu_facts()
    except Exception:
        gpus = []
    every = complete_permutation(gpu_pairs, [str(g["uuid"]) for g in gpus])
    candidates = [every] if every and set(every) != set(gpu_pairs) else []
    return candidates + [list(gpu_pairs)]


def complete_permutation(gpu_pairs: list[tuple[str, str]], uuids: list[str]) -> list[tuple[str, str]]:
    """Every GPU of ``uuids`` mapped, one to one: the pairs asked for, each other GPU onto itself
    where no pair takes it, the rest onto the GPUs left free, in the host's order. Empty when the
    pairs name a GPU this host lacks or map two GPUs onto one (then only the pairs are tried)."""
    mapping = dict(gpu_pairs)
    targets = [new for _, new in gpu_pairs]
    if len(targets) != len(set(targets)) or not set(mapping) | set(targets) <= set(uuids):
        return []
    free = [u for u in uuids if u not in set(targets)]
    rest = [u for u in uuids if u not in mapping]
    for uuid in rest:
        if uuid in free:
            mapping[uuid] = uuid
            free.remove(uuid)
    for uuid in rest:
        if uuid not in mapping:
            mapping[uuid] = free.pop(0)
    return [(u, mapping[u]) for u in uuids]


def _uuid_bytes(text: str) -> bytes:
    return bytes.fromhex(text.removeprefix("GPU-").replace("-", ""))


def _ctypes_restore(pid: int, gpu_pairs: list[tuple[str, str]]) -> int:
    """cuCheckpointProcessRestore with a GPU remap, through libcuda's C ABI (cuda.h layout)."""
    import ctypes

    class CUuuid(ctypes.Structure):
        _fields_ = [("bytes", ctypes.c_char * 16)]

    class GpuPair(ctypes.Structure):
        _fields_ = [("oldUuid", CUuuid), ("newUuid", CUuuid)]

    class RestoreArgs(ctypes.Structure):
        _fields_ = [("gpuPairs", ctypes.POINTER(GpuPair)), ("gpuPairsCount", ctypes.c_uint),
                    ("reserved", ctypes.c_char * (52 - ctypes.sizeof(ctypes.c_void_p))),
                    ("reserved1", ctypes.c_uint64)]

    pairs = (GpuPair * len(gpu_pairs))(*[GpuPair(CUuuid(_uuid_bytes(old)), CUuuid(_uuid_bytes(new)))
                                         for old, new in gpu_pairs])
    args = RestoreArgs(gpuPairs=pairs, gpuPairsCount=len(gpu_pairs))
    libcuda = ctypes.CDLL("libcuda.so.1")
    return int(libcuda.cuCheckpointProcessRestore(ctypes.c_int(pid), ctypes.byref(args)))


def _import_nvml() -> Any | None:
    """nvidia-ml-py's pynvml (vsnap[vllm]), else the copy vLLM 0.26 keeps inside itself (an install
    without the extra still reads the GPUs' memory); None where neither is there."""
    for name in ("pynvml", "vllm.third_party.pynvml"):
        try:
            return importlib.import_module(name)  # optional dependency: only a GPU host has either
        except ImportError:
            continue
    return None


@contextmanager
def _nvml() -> Iterator[Any | None]:
    """pynvml, initialised for the block and shut down after it; None where it is not installed
    or NVML cannot start (no NVIDIA driver: a CPU host, CI)."""
    pynvml = _import_nvml()
    if pynvml is None:
        yield None
        return
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        yield None
        return
    try:
        yield pynvml
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass


def _each_gpu(read: Callable[[Any, Any], T]) -> list[T] | None:
    """``read(pynvml, handle)`` of every GPU NVML sees, in its order, leaving out a GPU whose call
    fails (a MIG GPU does not list its processes: the others still answer); None where NVML
    cannot answer at all (not installed, no driver)."""
    with _nvml() as nvml:
        if nvml is None:
            return None
        # an unversioned call this driver lacks raises the mismatch error (not an NVMLError)
        failures = (nvml.NVMLError, getattr(nvml, "NVMLLibraryMismatchError", nvml.NVMLError))
        try:
            count = nvml.nvmlDeviceGetCount()
        except failures:
            return None
        found = []
        for index in range(count):
            try:
                found.append(read(nvml, nvml.nvmlDeviceGetHandleByIndex(index)))
            except failures:
                continue
        return found


def _text(value: str | bytes) -> str:
    """A string NVML returned (bytes from older nvidia-ml-py, str from current ones)."""
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def gpu_free_memory() -> dict[str, int]:
    """Free memory per GPU UUID, from NVML in this process (nvidia-smi, a process of its own, took
    most of a restore's verify phase); empty where NVML cannot answer (then no GPU is refused for
    its memory)."""
    rows = _each_gpu(lambda nvml, gpu: (_text(nvml.nvmlDeviceGetUUID(gpu)),
                                        int(nvml.nvmlDeviceGetMemoryInfo(gpu).free)))
    return dict(rows or [])


def gpu_memory_by_pid() -> dict[int, int]:
    """GPU memory each process uses (host PIDs; summed over its GPUs), from NVML; empty where NVML
    cannot answer. A process whose use NVML does not know (None) is left out."""
    per_gpu = _each_gpu(lambda nvml, gpu: [(int(p.pid), p.usedGpuMemory)
                                           for p in nvml.nvmlDeviceGetComputeRunningProcesses(gpu)])
    used: dict[int, int] = {}
    for pid, memory in (row for rows in per_gpu or [] for row in rows):
        if isinstance(memory, int) and memory >= 0:
            used[pid] = used.get(pid, 0) + memory
    return used


def _format_uuid(uuid: Any) -> str:
    """GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx, as nvidia-smi prints it."""
    raw = getattr(uuid, "bytes", b"")
    if isinstance(raw, str):
        raw = raw.encode("latin-1")
    hexed = bytes(raw).hex()
    if len(hexed) != 32:
        return "unknown"
    return "GPU-" + "-".join(hexed[a:b] for a, b in ((0, 8), (8, 12), (12, 16), (16, 20), (20, 32)))


def nvidia_driver_version() -> str | None:
    """The kernel module's version (for example 580.95.05), from /proc/driver/nvidia/version."""
    try:
        text = open("/proc/driver/nvidia/version").read()
    except OSError:
        return None
    import re

    match = re.search(r"Kernel Module\s+(?:for \S+\s+)?([0-9][0-9.]+)", text)
    return match.group(1) if match else None


def gpu_facts() -> tuple[str | None, str, list[dict[str, Any]]]:
    """NVIDIA driver version, CUDA driver API version and the visible GPUs (name, UUID, memory)."""
    driver = _driver()
    _, version = driver.cuDriverGetVersion()
    _, count = driver.cuDeviceGetCount()
    gpus = []
    for index in range(count):
        _, device = driver.cuDeviceGet(index)
        _, name = driver.cuDeviceGetName(64, device)
        _, uuid = driver.cuDeviceGetUuid(device)
        _, memory = driver.cuDeviceTotalMem(device)
        gpus.append({
            "index": index,
            "name": name.split(b"\0", 1)[0].decode() if isinstance(name, bytes) else str(name),
            "uuid": _format_uuid(uuid),
            "memory_bytes": int(memory),
        })
    return nvidia_driver_version(), f"{version // 1000}.{(version % 1000) // 10}", gpus
