"""Tensor parallelism across a CUDA checkpoint: the worker's NCCL communicators and CUDA graphs.

A CUDA checkpoint cannot carry what a process imported from another GPU (NCCL's peer buffers,
multicast objects), and every CUDA graph that captured a collective holds the communicator by
address (docs/design/tensor-parallel-2.md 2). So each worker, before the checkpoint:

1. drops every CUDA graph (vLLM's wrappers, the V2 runner's graph manager);
2. destroys the PyNccl communicator of every group with more than one rank, with a deadline,
   and puts a sentinel in its place (model code looks the communicator up on every call, so
   nothing else holds it);
3. checks that nothing cross-GPU is left: no custom all-reduce, symmetric memory, FlashInfer
   workspace, all-to-all manager, NCCL-registered memory or initialised torch NCCL group.

After the restore (and the wake), each worker builds fresh communicators over the restored gloo
groups, checks them with an all-reduce, and captures the CUDA graphs again, as vLLM does at
boot. The capture's rehearsal runs the whole cycle once, so a restore never runs a step for the
first time.

With one rank there is no communicator: the same methods drop and capture the graphs only
(vllm.rules.TP1_RECAPTURE_ENV turns that on, so one GPU exercises the path).

``TensorParallelExtension`` is mixed into vsnap's worker extension (weights.extension); the engine
calls its methods through ``collective_rpc``, which runs them on every rank at once (each step
that talks to the other rank needs that). The helpers take their vLLM and torch objects as
arguments where a test can give fakes.
"""

from __future__ import annotations

import gc
import threading
import time
from typing import Any, Callable, Iterable

DESTROY_DEADLINE_S = 30.0  # ncclCommAbort of a communicator no CUDA graph holds returns at once


class Disconnected:
    """What stands in a CudaCommunicator's ``pynccl_comm`` between disconnect and reconnect.

    ``disabled`` is False and ``available`` True on purpose: a disabled communicator would make
    vLLM fall back to torch.distributed on the NCCL device group, which would silently create a
    torch NCCL communicator (it cannot be rebuilt). Any use of it raises instead; ``destroy`` is a
    no-op so that vLLM's shutdown still works."""

    def __init__(self, group_name: str, world_size: int) -> None:
        self.group_name = group_name
        self.world_size = world_size
        self.disabled = False
        self.available = True

    def destroy(self) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # copy, pickle and friends probe dunders: those are plain absences
            raise AttributeError(name)
        raise RuntimeError(f"vsnap: NCCL of group {self.group_name} is disconnected for a checkpoint "
                           f"(used: {name}); vsnap_tp_reconnect rebuilds it")

    def __repr__(self) -> str:
        return f"Disconnected({self.group_name!r}, world_size={self.world_size})"


def comm_groups(groups: dict[str, Callable[[], Any]]) -> list[tuple[str, Any]]:
    """(name, coordinator) of every live vLLM group coordinator with a device communicator (those
    with more than one rank), from parallel_state._groups (name -> weak reference), by name."""
    found = []
    for name, ref in sorted(groups.items()):
        group = ref()
        if group is not None and getattr(group, "device_communicator", None) is not None:
            found.append((name, group))
    return found


def unsupported_state(name: str, dc: Any, fi_module: Any = None, allocator_module: Any = None) -> list[str]:
    """Why the device communicator ``dc`` of group ``name`` holds what cannot be rebuilt after a
    restore (empty when it holds only its PyNccl communicator). ``fi_module``: vLLM's
    flashinfer_all_reduce; ``allocator_module``: its pynccl_allocator (either may be None)."""
    reasons = []
    ca = getattr(dc, "ca_comm", None)
    if ca is not None and not getattr(ca, "disabled", False):
        reasons.append(f"{name}: custom all-reduce is on (CUDA IPC buffers); disable_custom_all_reduce must be true")
    if getattr(dc, "symm_mem_comm", None) is not None:
        reasons.append(f"{name}: torch symmetric memory holds a mapped buffer; VLLM_ALLREDUCE_USE_SYMM_MEM must be 0")
    if getattr(dc, "fi_ar_comm", None) is not None:
        reasons.append(f"{name}: FlashInfer all-reduce holds an IPC workspace; VLLM_ALLREDUCE_USE_FLASHINFER must be 0")
    for other in ("qr_comm", "aiter_ar_comm"):
        if getattr(dc, other, None) is not None:
            reasons.append(f"{name}: {other} holds IPC buffers")
    if getattr(dc, "all2all_manager", None) is not None:
        reasons.append(f"{name}: an all-to-all manager holds peer buffers (expert parallelism)")
    for workspace in ("_fi_ar_workspace", "_fi_ar_quant_workspace"):
        if fi_module is not None and getattr(fi_module, workspace, None) is not None:
            reasons.append(f"FlashInfer's {workspace} exists (the all-reduce + RMSNorm fusion); fuse_allreduce_rms must "
                           "be false")
    if allocator_module is not None and getattr(allocator_module, "_registered_base_addrs", None):
        reasons.append("memory is registered with NCCL (NCCL symmetric memory); VLLM_USE_NCCL_SYMM_MEM must be 0")
    return list(dict.fromkeys(reasons))


def call_with_deadline(fn: Callable[[], Any], seconds: float, what: str) -> Any:
    """Run ``fn`` in a daemon thread; its result, its exception, or TimeoutError naming ``what``
    when it has not returned within ``seconds`` (the thread is left behind: the caller fails)."""
    result: list[Any] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            result.append(fn())
        except BaseException as exc:  # handed to the caller
            error.append(exc)

    thread = threading.Thread(target=run, name=f"vsnap-{what}", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise TimeoutError(f"{what} did not return within {seconds:.0f} s")
    if error:
        raise error[0]
    return result[0] if result else None


def destroy_comm(name: str, comm: Any, deadline_s: float = DESTROY_DEADLINE_S) -> None:
    """Abort a PyNcclCommunicator synchronously, as its own destroy() does but failing closed:
    vLLM gives up silently after 5 s, and a communicator a CUDA graph still holds would then
    leak into the checkpoint."""
    if not getattr(comm, "available", False) or getattr(comm, "disabled", True):
        return
    import torch

    def abort() -> None:
        with torch.accelerator.device_index(comm.device.index):
            comm.nccl.ncclCommAbort(comm.comm)

    call_with_deadline(abort, deadline_s, f"ncclCommAbort of group {name} (a CUDA graph may still hold it)")
    comm.available, comm.disabled = False, True


def initialised_torch_nccl(pg_map: Iterable[Any], device: Any, nccl_type: Any) -> tuple[list[str], bool]:
    """The torch process groups whose NCCL backend has a communicator (names), and whether every
    NCCL backend could be asked (``_is_initialized`` is a private method of ProcessGroupNCCL)."""
    found, known = [], True
    for pg in pg_map:
        try:
            backend = pg._get_backend(device)
        except Exception:  # no backend for CUDA on this group (gloo only)
            continue
        if nccl_type is None or not isinstance(backend, nccl_type):
            continue
        check = getattr(backend, "_is_initialized", None)
        if check is None:
            known = False
            continue
        if check():
            found.append(str(getattr(pg, "group_name", None) or pg))
    return found, known


def disable_peer_access(driver: Any, device: int) -> dict[str, list[int]]:
    """Turn off peer access from ``device``'s primary context to every other visible GPU whose
    primary context this process holds (driver API: a GPU without one was never a peer, and
    asking the runtime would create a context there). Returns the peers it was on for, and the
    GPUs besides ``device`` where this process holds a primary context (each is in the image)."""
    _, count = driver.cuDeviceGetCount()
    enabled, contexts = [], []
    for peer in range(int(count)):
        if peer == device:
            continue
        _, handle = driver.cuDeviceGet(peer)
        err, _, active = driver.cuDevicePrimaryCtxGetState(handle)
        if int(err) != 0 or not active:
            continue
        contexts.append(peer)
        err, context = driver.cuDevicePrimaryCtxRetain(handle)
        if int(err) != 0:
            continue
        try:
            (err,) = driver.cuCtxDisablePeerAccess(context)
            if int(err) == 0:
                enabled.append(peer)
        finally:
            driver.cuDevicePrimaryCtxRelease(handle)
    return {"peer_access_was_on": enabled, "other_gpu_contexts": contexts}


def drop_cuda_graphs(model_runner: Any, wrapper_classes: Iterable[Any] | None = None) -> int:
    """Drop every CUDA graph of this worker: vLLM's graph wrappers (torch.compile's piecewise
    graphs, the V1 runner's full ones) and the V2 runner's graph manager (which then runs eager
    until capture_model). Returns how many the V2 manager held (the wrappers do not say).
    Refuses a speculator with graphs of its own (vsnap does not drop those)."""
    speculator = getattr(model_runner, "speculator", None)
    if speculator is not None and getattr(speculator, "cudagraph_manager", None) is not None:
        raise RuntimeError("vsnap: the speculator captures CUDA graphs of its own, which vsnap does not drop and "
                           "capture again")
    for cls in wrapper_classes if wrapper_classes is not None else _graph_wrapper_classes():
        cls.clear_all_graphs()
    dropped = 0
    manager = getattr(model_runner, "cudagraph_manager", None)
    graphs = getattr(manager, "graphs", None)
    if isinstance(graphs, dict):
        dropped = len(graphs)
        graphs.clear()
        manager._graphs_captured = False
    return dropped


def _graph_wrapper_classes() -> list[Any]:
    classes = []
    try:
        from vllm.compilation.cuda_graph import CUDAGraphWrapper

        classes.append(CUDAGraphWrapper)
    except ImportError:
        pass
    try:
        from vllm.compilation.breakable_cudagraph import BreakableCUDAGraphWrapper

        classes.append(BreakableCUDAGraphWrapper)
    except ImportError:
        pass
    return classes


def _optional_module(name: str) -> Any:
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError:
        return None


class TensorParallelExtension:
    """Methods added to vLLM's GPU worker (with WeightsFileExtension); every rank runs each."""

    def vsnap_tp_disconnect(self) -> dict[str, Any]:
        """Before vsnap_before_sleep and sleep, awake (freeing a sleeping allocation would unmap
        it twice): drop the CUDA graphs, destroy the NCCL communicators, check nothing
        cross-GPU is left. Raises on anything that cannot be rebuilt after a restore."""
        import torch
        from vllm.distributed import parallel_state

        start = time.monotonic()
        torch.cuda.synchronize()
        graphs = drop_cuda_graphs(self.model_runner)  # type: ignore[attr-defined]
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        groups = comm_groups(parallel_state._groups)
        fi_module = _optional_module("vllm.distributed.device_communicators.flashinfer_all_reduce")
        allocator_module = _optional_module("vllm.distributed.device_communicators.pynccl_allocator")
        reasons = [r for name, g in groups for r in unsupported_state(name, g.device_communicator, fi_module,
                                                                      allocator_module)]
        if reasons:
            raise RuntimeError("vsnap cannot disconnect tensor parallelism: " + "; ".join(reasons))
        names = []
        for name, group in groups:
            dc = group.device_communicator
            comm = getattr(dc, "pynccl_comm", None)
            if comm is None or isinstance(comm, Disconnected):
                continue
            destroy_comm(name, comm)
            dc.pynccl_comm = Disconnected(name, int(getattr(comm, "world_size", group.world_size)))
            names.append(name)
        self._vsnap_disconnected = names
        torch.cuda.synchronize()
        nccl_type = getattr(torch.distributed, "ProcessGroupNCCL", None)
        world = getattr(torch.distributed.distributed_c10d, "_world", None)
        initialised, known = initialised_torch_nccl(list(getattr(world, "pg_map", {}) or {}),
                                                    torch.device("cuda"), nccl_type)
        tp = len(groups) > 0
        if initialised and tp:
            raise RuntimeError(f"vsnap: torch NCCL communicators exist in {', '.join(initialised)}; they cannot be "
                               "rebuilt after a restore (something ran a collective outside vLLM's PyNccl)")
        if not known and tp:
            raise RuntimeError("vsnap: this torch cannot say whether its NCCL process groups hold a communicator "
                               "(ProcessGroupNCCL._is_initialized is missing)")
        try:
            from cuda.bindings import driver
        except ImportError:  # vsnap's GPU path installs it (the CUDA checkpoint API): no peers to look at without it
            peers: dict[str, list[int]] = {"peer_access_was_on": [], "other_gpu_contexts": []}
        else:
            peers = disable_peer_access(driver, torch.cuda.current_device())
        return {"graphs_dropped": float(graphs), "comms_destroyed": float(len(names)),
                "torch_nccl_initialised": float(len(initialised)), "torch_nccl_known": float(known),
                "peer_access_disabled": float(len(peers["peer_access_was_on"])),
                "other_gpu_contexts": float(len(peers["other_gpu_contexts"])),
                "disconnect_s": time.monotonic() - start}

    def vsnap_tp_reconnect(self, timeout_s: float) -> dict[str, float]:
        """After the wake (weights and KV cache mapped): a bounded gloo barrier over each group
        vsnap_tp_disconnect took apart (the restored TCP pairs work), a fresh PyNccl
        communicator as vLLM builds it, and an all-reduce that must sum the ranks."""
        import datetime

        import torch
        import torch.distributed as dist
        from vllm.distributed import parallel_state
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator

        start = time.monotonic()
        names: list[str] = getattr(self, "_vsnap_disconnected", [])
        for name in names:
            ref = parallel_state._groups.get(name)
            group = ref() if ref is not None else None
            if group is None or group.device_communicator is None:
                raise RuntimeError(f"vsnap: group {name} is gone; its NCCL communicator cannot be rebuilt")
            dc = group.device_communicator
            dist.monitored_barrier(group=dc.cpu_group, timeout=datetime.timedelta(seconds=timeout_s),
                                   wait_all_ranks=True)
            comm = PyNcclCommunicator(group=dc.cpu_group, device=dc.device)
            n = comm.world_size
            probe = torch.tensor([float(comm.rank + 1)], device=dc.device)
            total = comm.all_reduce(probe)
            torch.cuda.synchronize()
            got = float((total if total is not None else probe).item())
            if got != n * (n + 1) / 2:
                raise RuntimeError(f"vsnap: the rebuilt NCCL of group {name} summed {got}, not {n * (n + 1) / 2}")
            dc.pynccl_comm = comm
        self._vsnap_disconnected = []
        return {"nccl_init_s": time.monotonic() - start, "comms_reconnected": float(len(names))}

    def vsnap_recapture_graphs(self) -> dict[str, float]:
        """After reconnect: capture the CUDA graphs again as vLLM does at boot (the workspace
        unlocked around it, as vLLM's elastic EP does, and left locked only if it was: the V1
        runner locks it after its boot capture, the V2 runner does not); nothing with
        enforce_eager."""
        from vllm.v1.worker.workspace import current_workspace_manager

        start = time.monotonic()
        runner = self.model_runner  # type: ignore[attr-defined]
        mode = self.vllm_config.compilation_config.cudagraph_mode  # type: ignore[attr-defined]
        if mode is None or getattr(mode, "name", str(mode)) == "NONE":
            return {"graph_capture_s": 0.0, "graph_bytes": 0.0}
        workspace = current_workspace_manager()
        locked = workspace.is_locked()
        workspace.unlock()
        try:
            nbytes = runner.capture_model()
        finally:
            if locked:
                workspace.lock()
        return {"graph_capture_s": time.monotonic() - start, "graph_bytes": float(nbytes or 0)}
