"""What holds GPU memory after vLLM's sleep level 2, and what releasing it costs (GPU machine).

    python scripts/gpu_probe_sleep.py baseline            a process with only a CUDA context (+ cuBLAS)
    python scripts/gpu_probe_sleep.py compose MODEL       vLLM's pool, then destructive steps, one by one
    python scripts/gpu_probe_sleep.py graphs MODEL        the CUDA graph pool in the sleep allocator: two
                                                          sleep/wake/reload rounds (the second also frees
                                                          cuBLAS's workspaces), outputs compared after each

vLLM runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so the worker is reachable here.
Each mode prints one JSON line (prefixed "PROBE ") with bytes at each step; graphs also prints
each round as it ends ("PROBE-STEP "), since a CUDA fault ends the process.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")

PROMPTS = [f"Prompt {i}: the numbers {i}, {i * 3}, {i * 7} and" for i in range(8)]


def smi_used(pid: int) -> int | None:
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True).stdout
    for line in out.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) == 2 and fields[0] == str(pid):
            return int(fields[1]) << 20
    return None


def used() -> int:
    import torch

    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return int(total - free)


def baseline() -> dict[str, Any]:
    import torch

    rows = {"before_cuda": None}
    torch.zeros(1, device="cuda")
    rows["context"] = used()
    rows["context_smi"] = smi_used(os.getpid())
    a = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
    (a @ a).sum().item()
    rows["context_cublas"] = used()
    rows["context_cublas_smi"] = smi_used(os.getpid())
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
    rows["context_cublas_cleared"] = used()
    rows.update(context_limits())
    return rows


def context_limits() -> dict[str, Any]:
    """The context's own reservations that a limit sizes (per-thread stack = local memory for every
    resident thread, device malloc heap, printf FIFO): used bytes after setting each lower."""
    try:
        from cuda.bindings import driver as cu
    except ImportError:
        return {"limits": "no cuda.bindings"}
    rows: dict[str, Any] = {}
    for name, low in (("CU_LIMIT_STACK_SIZE", 0), ("CU_LIMIT_MALLOC_HEAP_SIZE", 0), ("CU_LIMIT_PRINTF_FIFO_SIZE", 4096)):
        limit = getattr(cu.CUlimit, name)
        err, value = cu.cuCtxGetLimit(limit)
        before = used()
        (set_err,) = cu.cuCtxSetLimit(limit, low)
        rows[name] = {"default": int(value) if int(err) == 0 else str(err), "set_to": low,
                      "set_result": str(set_err), "freed_bytes": before - used()}
    return rows


def make_llm(model: str) -> Any:
    from vllm import LLM

    return LLM(model=model, enable_sleep_mode=True, gpu_memory_utilization=0.5, max_model_len=2048, seed=0)


def generate(llm: Any) -> list[tuple[list[int], list[float]]]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=16, min_tokens=16, ignore_eos=True, logprobs=1, seed=0)
    out = []
    for result in llm.generate(PROMPTS, params, use_tqdm=False):
        c = result.outputs[0]
        out.append((list(c.token_ids), [float(p[t].logprob) for t, p in zip(c.token_ids, c.logprobs)]))
    return out


def pools() -> dict[str, Any]:
    from vsnap.engine.adapters.vllm.weights.pool import device_memory_report

    return device_memory_report()


def graph_wrappers() -> list[Any]:
    from vllm.compilation.cuda_graph import CUDAGraphWrapper

    found = list(CUDAGraphWrapper._all_instances)
    try:
        from vllm.compilation.breakable_cudagraph import BreakableCUDAGraphWrapper

        found += list(BreakableCUDAGraphWrapper._all_instances)
    except ImportError:
        pass
    return found


def top_default_blocks(n: int = 12) -> list[dict[str, Any]]:
    """The largest live blocks of torch's default pool, with the innermost frames that made them."""
    import torch

    blocks = []
    for segment in torch.cuda.memory_snapshot():
        if tuple(segment.get("segment_pool_id", (0, 0))) != (0, 0):
            continue
        for block in segment.get("blocks", []):
            if block.get("state") != "active_allocated":
                continue
            frames = [f"{Path(f['filename']).name}:{f['line']}:{f['name']}" for f in block.get("frames", [])
                      if "torch/" not in f["filename"] or "nn/modules" in f["filename"]][:4]
            blocks.append({"bytes": block["size"], "frames": frames})
    blocks.sort(key=lambda b: -b["bytes"])
    return blocks[:n]


def compose(model: str) -> dict[str, Any]:
    import torch

    torch.cuda.memory._record_memory_history(max_entries=200000, stacks="python")
    rows: dict[str, Any] = {}
    llm = make_llm(model)
    generate(llm)
    rows["awake"] = used()
    llm.sleep(level=2)
    rows["asleep"] = used()
    rows["asleep_smi"] = smi_used(os.getpid())
    rows["pools_asleep"] = pools()
    rows["top_default_blocks"] = top_default_blocks()
    gc.collect()
    torch.cuda.empty_cache()
    rows["gc_empty_cache"] = used()
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
    rows["cublas_cleared"] = used()
    wrappers = graph_wrappers()
    rows["graph_wrappers"] = len(wrappers)
    rows["graphs"] = sum(len(w.concrete_cudagraph_entries) for w in wrappers if hasattr(w, "concrete_cudagraph_entries"))
    by_mode: dict[str, int] = {}
    for w in wrappers:
        mode = str(getattr(w, "runtime_mode", "?"))
        by_mode[mode] = by_mode.get(mode, 0) + len(getattr(w, "concrete_cudagraph_entries", {}))
    rows["graphs_by_mode"] = by_mode
    for mode in sorted(by_mode):  # destructive from here on: drop the graphs, one mode at a time
        for w in wrappers:
            if str(getattr(w, "runtime_mode", "?")) == mode:
                for entry in w.concrete_cudagraph_entries.values():
                    if getattr(entry, "cudagraph", None) is not None:
                        entry.cudagraph.reset()
                w.clear_graphs()
        gc.collect()
        torch.cuda.empty_cache()
        rows[f"graphs_{mode}_dropped"] = used()
    rows["pools_after_graphs"] = pools()
    return rows


def graphs(model: str) -> dict[str, Any]:
    """The graph pool in the sleep allocator: two sleep/wake/reload rounds, the second also freeing
    cuBLAS's workspaces after the sleep; each round's result is printed as soon as it is known (a
    CUDA fault ends the process)."""
    import torch

    from vsnap.engine.adapters.vllm.weights.pool import route_graph_pool_to_sleep_allocator, tag_graph_pool

    rows: dict[str, Any] = {"routed": route_graph_pool_to_sleep_allocator()}
    llm = make_llm(model)
    before = generate(llm)
    rows["awake"] = used()
    print("PROBE-STEP " + json.dumps(rows), flush=True)
    for name, clear_cublas in (("graph_pool", False), ("graph_pool_and_cublas", True)):
        step: dict[str, Any] = {"round": name, "graph_pool_tagged": tag_graph_pool()}
        llm.sleep(level=2)
        step["asleep"] = used()
        if clear_cublas:
            torch._C._cuda_clearCublasWorkspaces()
            torch.cuda.empty_cache()
            step["asleep_cublas_cleared"] = used()
        step["pools_asleep"] = pools()
        print("PROBE-STEP " + json.dumps(step), flush=True)
        start = time.monotonic()
        llm.wake_up(tags=["weights"])
        llm.collective_rpc("reload_weights")
        llm.wake_up(tags=["kv_cache"])
        step["wake_reload_s"] = time.monotonic() - start
        after = generate(llm)
        step["tokens_equal"] = [a[0] == b[0] for a, b in zip(before, after)]
        step["max_logprob_diff"] = max(abs(x - y) for a, b in zip(before, after) for x, y in zip(a[1], b[1]))
        print("PROBE-STEP " + json.dumps(step), flush=True)
        rows[name] = step
    return rows


if __name__ == "__main__":
    mode = sys.argv[1]
    result = baseline() if mode == "baseline" else {"compose": compose, "graphs": graphs}[mode](sys.argv[2])
    print("PROBE " + json.dumps({"mode": mode, **result}, default=str), flush=True)
    os._exit(0)  # vLLM's shutdown is not what is measured
