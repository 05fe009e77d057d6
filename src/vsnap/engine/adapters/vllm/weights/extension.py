"""vsnap's one worker extension: ``WeightsFileExtension`` is mixed into vLLM's GPU worker (vLLM's
``worker_extension_cls``, named by EXTENSION); the engine calls its methods through
``collective_rpc``. The layout (names, sizes) and views of the tensors are kept in the worker's
memory, which the CRIU image carries: a restore checks every parameter still lives in a storage
the file covers before it copies a byte.

Importing this module in the worker routes vLLM's CUDA graph pool into the sleep allocator when
GRAPH_POOL_ENV is "sleep" (the adapter sets it for the worker it spawns).
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from vsnap.engine.adapters.vllm.tp import TensorParallelExtension
from vsnap.engine.heap import freeze_heap, release_heap

from .copiers import UNLOCK_PAUSE_S, LockedPages, UnlockRefused, release_all, stream_into
from .layout import Segment, file_name, fingerprint, layout
from .pool import (
    device_memory_report,
    pool_membership,
    pool_tensors,
    route_graph_pool_to_sleep_allocator,
    tag_graph_pool,
    weights_pool_ranges,
)

if TYPE_CHECKING:  # references and reference_copiers need numpy: imported when weights by reference are asked for
    from .references import Plan

EXTENSION = f"{__name__}.WeightsFileExtension"
STACK_ENV = "VSNAP_CUDA_STACK"  # "keep" in the capture's environment: the stack reservation stays in the checkpoint (default: lower_stack_limit)
GRAPH_POOL_ENV = "VSNAP_GRAPH_POOL"  # "sleep": the worker routes the pool when it imports this module
# "1" in the capture's environment: the weights file refers to the model's safetensors for the bytes they
# hold (references.py; the adapter passes the model directory to vsnap_save_weights). Opt-in (default off)
BY_REFERENCE_ENV = "VSNAP_WEIGHTS_BY_REFERENCE"


class WeightsFileExtension(TensorParallelExtension):
    """Methods added to vLLM's GPU worker; called with ``collective_rpc("vsnap_...")``. vsnap's one
    worker extension: the tensor-parallel methods (tp) are mixed in, under the one name specs
    and images carry (EXTENSION, rules.VSNAP_WORKER_EXTENSION)."""

    def _vsnap_model(self) -> Any:
        return self.model_runner.get_model()  # type: ignore[attr-defined]

    def _vsnap_rank(self) -> int:
        return int(getattr(self, "rank", 0))

    def vsnap_save_weights(self, directory: str, model_dir: str | None = None) -> dict[str, Any]:
        """Write the weights pool's tensors (pool_tensors) to DIRECTORY/rank<N>.bin (called while
        the weights are loaded); the worker keeps the views to refill after a wake.

        With ``model_dir`` (weights by reference, BY_REFERENCE_ENV): the bytes that are the model
        directory's own safetensors tensors are not written; the file holds the rest, and the plan
        of where each byte comes from (references.Plan) is kept in memory like the layout, and
        written beside the file as rank<N>.refs.json for the host and for people."""
        start = time.monotonic()
        named = pool_tensors(self._vsnap_model())
        spent: dict[str, float] = {"find_tensors_s": time.monotonic() - start}
        if not named:
            raise RuntimeError("the weights are not in vLLM's sleep allocator (is sleep mode on?)")
        os.makedirs(directory, mode=0o700, exist_ok=True)
        path = Path(directory) / file_name(self._vsnap_rank())
        plan: Plan | None = None
        with open(path, "wb") as f:
            if model_dir is None:
                for _, tensor in named:
                    f.write(memoryview(tensor.cpu().numpy()))
            else:
                from .references import write_by_reference

                plan = write_by_reference(f, _host_copies(named), model_dir,
                                          parts=self._vsnap_tensor_parallel_size(), spent=spent)
            synced = time.monotonic()
            f.flush()
            os.fsync(f.fileno())
            spent["fsync_s"] = time.monotonic() - synced
        summed = time.monotonic()
        self._vsnap_layout = layout(named)
        self._vsnap_targets = [t for _, t in named]
        self._vsnap_sums = fingerprint(named)
        self._vsnap_plan = plan
        spent["fingerprint_s"] = time.monotonic() - summed
        parameters = sum(1 for name, _ in named if not name.startswith("tensor@"))
        others = sorted(((t.numel(), name) for name, t in named if name.startswith("tensor@")), reverse=True)
        report: dict[str, Any] = {"weights_bytes": float(path.stat().st_size), "weights_save_s": time.monotonic() - start,
                                  "tensors": float(len(named)), "parameter_storages": float(parameters),
                                  "other_bytes": float(sum(n for n, _ in others)),
                                  "largest_others": "; ".join(f"{name} {n / 1e6:.1f} MB" for n, name in others[:4]),
                                  **{f"weights_save_{k}": v for k, v in spent.items()}}
        if plan is not None:
            self._vsnap_write_plan(directory, plan)
            report.update({"referenced_bytes": float(plan.referenced_bytes), "literal_bytes": float(plan.literal_bytes),
                           "reference_extents": float(sum(1 for e in plan.extents if e.source >= 0)),
                           "referenced_files": float(len(plan.files))})
            if plan.skipped:
                report["skipped_model_files"] = "; ".join(f"{name}: {why}" for name, why in plan.skipped)
        return report

    def _vsnap_tensor_parallel_size(self) -> int:
        return int(getattr(getattr(self, "parallel_config", None), "tensor_parallel_size", 1) or 1)

    def _vsnap_write_plan(self, directory: str, plan: Plan) -> None:
        """DIRECTORY/rank<N>.refs.json: the plan as people and the host read it (the worker uses the
        plan it keeps in memory)."""
        from .references import plan_file_name

        rank_file = file_name(self._vsnap_rank())
        fd = os.open(Path(directory) / plan_file_name(self._vsnap_rank()),
                     os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with open(fd, "w") as f:  # never through a link, as the rank file's refresh
            f.write(plan.to_json(rank_file))
            f.flush()
            os.fsync(f.fileno())

    def vsnap_start_loading_weights(self, directory: str) -> None:
        """Start streaming DIRECTORY/rank<N>.bin into the (awake, empty) weights pool in the
        background, so the KV cache can be woken meanwhile; vsnap_finish_loading_weights waits."""
        saved: list[Segment] | None = getattr(self, "_vsnap_layout", None)
        if saved is None:
            raise RuntimeError("no weights file was written by this process")
        held = {t.data_ptr(): t.numel() for t in self._vsnap_targets}
        in_pool = pool_membership(weights_pool_ranges())
        for name, p in self._vsnap_model().named_parameters():
            storage = p.untyped_storage()
            if p.is_cuda and in_pool(storage.data_ptr()) and held.get(storage.data_ptr()) != storage.nbytes():
                raise RuntimeError(f"the model's parameters changed since the weights file was written ({name})")
        path = Path(directory) / file_name(self._vsnap_rank())
        self.vsnap_unlock_weights_file(background=False)  # an earlier load's pages, if any (raises if they stay)
        locked: list[LockedPages] = []
        self._vsnap_locked = locked
        pool = ThreadPoolExecutor(max_workers=1)
        plan: Plan | None = getattr(self, "_vsnap_plan", None)
        if plan is not None:  # weights by reference: each extent from a model file or the rank file
            from .reference_copiers import stream_plan_into

            self._vsnap_loading = (pool, pool.submit(stream_plan_into, plan, path, saved, self._vsnap_targets,
                                                     unlock_later=locked.append))
            return
        self._vsnap_loading = (pool, pool.submit(stream_into, path, saved, self._vsnap_targets,
                                                 unlock_later=locked.append))

    def vsnap_unlock_weights_file(self, background: bool) -> dict[str, float]:
        """Unlock the weights file's pages that the last load left locked (dma_into's
        unlock_later). A restore does it once the server serves, in a thread of its own,
        piece by piece (``background``: each unlock waits for the GPU's work in flight and holds
        the driver's lock, so it delays the next launch by a few milliseconds); before a sleep,
        and so before any checkpoint, it is done at once, after any background unlocking, and a
        piece the driver will not unlock fails the call (UnlockRefused): nothing is checkpointed
        with pages locked."""
        running: threading.Thread | None = getattr(self, "_vsnap_unlocking", None)
        if running is not None:
            running.join()
            self._vsnap_unlocking = None
        locked: list[LockedPages] = getattr(self, "_vsnap_locked", [])
        if not locked:
            return {}
        if not background:
            return release_all(locked, 0.0)  # empties `locked`; raises with the refused pieces kept in it
        pieces = float(sum(p.pieces for p in locked))

        def unlock() -> None:  # the list stays the worker's until every piece is unlocked
            try:
                print(f"vsnap: weights file unlocked: {release_all(locked, UNLOCK_PAUSE_S)}", flush=True)
            except UnlockRefused as refused:
                print(f"vsnap: {refused}", flush=True)

        self._vsnap_unlocking = threading.Thread(target=unlock, name="vsnap-unlock-weights", daemon=True)
        self._vsnap_unlocking.start()
        return {"unlocking_pieces": pieces}

    def vsnap_refresh_weights(self, directory: str) -> dict[str, float]:
        """Rewrite, in place, the file's pieces whose tensors changed since it was written (the
        oracle and the rehearsal between the save and the checkpoint move LoRA adapters between
        slots): the file must hold the pool as the image's CPU state expects it. By reference,
        a referenced range that changed becomes literal (appended to the file; refresh_plan)."""
        start = time.monotonic()
        named = list(zip((seg.name for seg in self._vsnap_layout), self._vsnap_targets))
        now = fingerprint(named)
        changed = [k for k, (seg, (name, tensor)) in enumerate(zip(self._vsnap_layout, named))
                   if now[name] != self._vsnap_sums.get(name)]
        plan: Plan | None = getattr(self, "_vsnap_plan", None)
        if changed and plan is not None:
            made_literal = self._vsnap_refresh_plan(directory, plan, changed)
            self._vsnap_sums = now
            return {"refreshed_tensors": float(len(changed)), "references_made_literal": float(made_literal),
                    "refresh_s": time.monotonic() - start}
        if changed:
            fd = os.open(Path(directory) / file_name(self._vsnap_rank()), os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
            try:
                for k in changed:
                    data = memoryview(self._vsnap_targets[k].cpu().numpy())
                    if os.pwrite(fd, data, self._vsnap_layout[k].offset) != len(data):
                        raise OSError(f"short write refreshing {self._vsnap_layout[k].name}")
                os.fsync(fd)
            finally:
                os.close(fd)
            self._vsnap_sums = now
        return {"refreshed_tensors": float(len(changed)), "refresh_s": time.monotonic() - start}

    def _vsnap_refresh_plan(self, directory: str, plan: Plan, changed: list[int]) -> int:
        """vsnap_refresh_weights by reference: the changed tensors (indices) through refresh_plan;
        the new plan kept, and written beside the file when a reference became literal. Returns
        how many did."""
        from .references import refresh_plan

        changed_bytes = ((self._vsnap_layout[k].offset, self._vsnap_targets[k].cpu().numpy()) for k in changed)
        fd = os.open(Path(directory) / file_name(self._vsnap_rank()), os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            new, made_literal = refresh_plan(plan, fd, changed_bytes)
            os.fsync(fd)
        finally:
            os.close(fd)
        self._vsnap_plan = new
        if made_literal:
            self._vsnap_write_plan(directory, new)
        return made_literal

    def vsnap_fingerprint(self) -> dict[str, int]:
        """Checksums of the parameters, the buffers and the weights file's tensors (while awake)."""
        model = self._vsnap_model()
        named = [(f"parameter {n}", p) for n, p in model.named_parameters() if p.is_cuda and p.numel()]
        named += [(f"buffer {n}", b) for n, b in model.named_buffers() if b.is_cuda and b.numel()]
        named += [(f"tensor {n}", t) for n, t in zip((s.name for s in getattr(self, "_vsnap_layout", [])),
                                                     getattr(self, "_vsnap_targets", []))]
        return fingerprint(named)

    def vsnap_finish_loading_weights(self) -> dict[str, float]:
        pool, future = self._vsnap_loading
        try:
            return future.result()
        finally:
            pool.shutdown()
            del self._vsnap_loading

    def vsnap_before_sleep(self) -> dict[str, float]:
        """Before vLLM's sleep: the CUDA graph pool is tagged to be unmapped with the KV cache."""
        return {"graph_pool_tagged_bytes": float(tag_graph_pool())}

    def vsnap_release_memory(self) -> dict[str, float]:
        """After vLLM's sleep, before a checkpoint: drop what the image need not carry (freed blocks
        of torch's cache, freed heap), freeze what is left of the heap (engine.heap.freeze_heap),
        and report what is left (device_memory_report) and the collection's time.

        Not cuBLAS's workspaces (``torch._C._cuda_clearCublasWorkspaces()``, 67 MB on the 8B):
        captured CUDA graphs use them, and on the 8B the first request after a wake then hit an
        illegal memory access (H200, 2026-12-01; the tiny model happened to survive it)."""
        import torch

        torch.cuda.synchronize()
        start = _device_used()
        collect_s = release_heap()  # first: a collected tensor's block can then be returned
        torch.cuda.empty_cache()
        stack: dict[str, float] = {}
        if os.environ.get(STACK_ENV) != "keep" and getattr(self, "_vsnap_stack_limit", None) is None:
            lowered = lower_stack_limit()  # not twice without a wake: the second would record 0
            if lowered is not None:
                self._vsnap_stack_limit, freed = lowered
                stack = {"stack_freed_bytes": float(freed)}
        frozen = freeze_heap()  # last: what the image holds is frozen (heap.freeze_heap says why)
        return {**device_memory_report(), **stack, "freed_bytes": float(start - _device_used()),
                "gc_collect_s": collect_s, "gc_frozen_objects": float(frozen)}

    def vsnap_restore_stack_limit(self) -> dict[str, float]:
        """At a wake, before any kernel runs: the stack limit vsnap_release_memory lowered goes
        back to what it was when the CUDA graphs were captured (their kernels do not grow it)."""
        limit: int | None = getattr(self, "_vsnap_stack_limit", None)
        if limit is None:
            return {}
        result = set_stack_limit(limit)  # raises on a refusal: the value stays for the next try
        self._vsnap_stack_limit = None
        return result


def lower_stack_limit() -> tuple[int, int] | None:
    """Give back the context's per-thread stack reservation before the checkpoint: (the limit it
    had, the device bytes freed), or None where nothing was lowered.

    The CUDA context reserves stack for every thread the GPU can hold resident (1 KiB by default x
    2048 threads x 132 SMs on an H200: 277 MB of a bare context's 651 MB), and that memory is
    copied to the host by the CUDA checkpoint, written and read by CRIU, and copied back at every
    restore. Every wake sets the limit back before any kernel runs (set_stack_limit, through the
    worker's vsnap_restore_stack_limit), so the graphs replay with the stack they were captured
    with: lowered and left at 0, the 8B's rehearsal failed at its first request after the wake
    with "CUDA error: unspecified launch failure" (H200, vLLM 0.26, 2026-12-01; kernels replayed
    from CUDA graphs do not grow the stack as plain launches do). Put back, the 8B's rehearsal, two
    restores and an activation gave the oracle bit for bit, with 1033 to 1102 MB of device memory
    left at sleep instead of 1310, and the CUDA restore took 0.50 s instead of 0.61 (H200, session 10).

    On by default; ``VSNAP_CUDA_STACK=keep`` in the environment of `vsnap capture` turns it off.
    """
    try:
        from cuda.bindings import driver as cu
    except ImportError:
        return None
    limit = cu.CUlimit.CU_LIMIT_STACK_SIZE
    err, value = cu.cuCtxGetLimit(limit)
    if int(err) != 0 or not value:  # nothing to give back (or it was lowered already)
        return None
    before = _device_used()
    (result,) = cu.cuCtxSetLimit(limit, 0)
    if int(result) != 0:
        return None
    return int(value), before - _device_used()


def set_stack_limit(value: int) -> dict[str, float]:
    """Set the current context's per-thread stack limit back to ``value`` (the limit
    lower_stack_limit returned); a refusal is an error: kernels replayed from graphs could then
    fault, so the restore stops before its oracle."""
    import torch
    from cuda.bindings import driver as cu

    torch.cuda.synchronize()  # the device's primary context current on this thread
    start = time.monotonic()
    (result,) = cu.cuCtxSetLimit(cu.CUlimit.CU_LIMIT_STACK_SIZE, value)
    if int(result) != 0:
        raise RuntimeError(f"cuCtxSetLimit(CU_LIMIT_STACK_SIZE, {value}): {result}")
    return {"stack_restore_s": time.monotonic() - start}


def _host_copies(named: list[tuple[str, Any]]) -> Iterator[Any]:
    """Each tensor's bytes on the host, in order. write_by_reference takes them on a helper thread,
    which first makes the tensors' GPU its current device: a new thread's is GPU 0, and on another
    rank's GPU a device guard switching back to it could make a context on GPU 0, which the
    checkpoint would then hold."""
    import torch

    device = named[0][1].device if named else None
    if device is not None and device.type == "cuda":
        torch.cuda.set_device(device)
    for _, tensor in named:
        yield tensor.cpu().numpy()


def _device_used() -> int:
    import torch

    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return int(total - free)


if os.environ.get(GRAPH_POOL_ENV) == "sleep":  # set by the vllm adapter for its worker (spawned after)
    route_graph_pool_to_sleep_allocator()
