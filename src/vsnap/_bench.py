"""run_bench(): cold start vs restore to first token, in one run, with the breakdown and the floor.

* cold start to first token: the engine tree launched in "serve" mode (the same code, without the
  snapshot work), from launch to the first HTTP completion; "fully cold" with an empty compile
  cache, then "warm cache" reusing it (vLLM; the cpu engine has no compile cache);
* capture: `capture_image()` of the spec, with the warm cache;
* restore to first token: `restore_image()` plus the first completion, ``runs`` times;
* floor: the image's CRIU bytes over this disk's measured read bandwidth (8 threads, page cache as
  it is), plus the weight bytes over the slower of that bandwidth and the measured host-to-device
  bandwidth (vLLM: pinned copies in a CUDA subprocess; cpu: the read bandwidth).
"""

from __future__ import annotations

import datetime as dt
import json
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from .protocol import control
from ._capture import capture_image, launch_config, resolve_model, tree_environment
from ._events import ProgressCallback, Timings
from ._host import host_facts, require_host
from ._instances import new_instance_dir
from ._manifest import WEIGHTS_DIR
from ._proctree import kill_tree, launch_tree
from ._restore import _wait_status, hand_over_listener, restore_image, stop_server
from ._shm import instance_shm_dir, remove_instance_shm
from ._spec import ModelSpec


def first_token(url: str, model: str) -> None:
    body = json.dumps({"model": model, "prompt": "Hello", "max_tokens": 1, "temperature": 0}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        json.load(response)["choices"][0]


def cold_start(spec: ModelSpec, env_extra: dict[str, str]) -> float:
    """Launch → first token of a plain engine (no snapshot work)."""
    control_dir = control.ensure_private_dir(Path(f"{spec.control_dir}-bench"))
    instance_id, work = new_instance_dir(control_dir, "cold")
    launch = launch_config(spec, resolve_model(spec)).model_copy(update={"mode": "serve"})
    control.write_message(work, control.LAUNCH, launch)
    shm = instance_shm_dir(instance_id)
    env = {**tree_environment(control_dir, work, spec.engine), **env_extra}
    heartbeat = control.OwnerHeartbeat(work).start()
    start = time.monotonic()
    tree = launch_tree(control_dir, work, shm, env)
    try:
        _wait_status(work, tree.root_pid, ("validated",), "boot engine", work / control.ENGINE_LOG)
        status = hand_over_listener(work, tree.root_pid, "127.0.0.1", 0, work / control.ENGINE_LOG)
        first_token(f"http://127.0.0.1:{status.detail['port']}", spec.served_model_name)
        return time.monotonic() - start
    finally:
        heartbeat.stop()
        kill_tree(tree.root_pid)
        tree.unshare.wait()
        remove_instance_shm(shm)


def read_bandwidth(paths: list[Path], threads: int = 8, piece: int = 32 << 20) -> float:
    """Bytes per second reading these files in 32 MiB pieces on 8 threads, each into its own
    reused buffer (as a restore streams the weights file), from whatever the page cache holds."""
    import itertools
    import os
    from concurrent.futures import ThreadPoolExecutor

    jobs = [(path, offset) for path in paths for offset in range(0, path.stat().st_size, piece)]
    counter = itertools.count()
    buffers = [bytearray(piece) for _ in range(threads)]  # allocated (and zeroed) before the clock starts

    def reader(buffer: bytearray) -> int:
        total = 0
        while (index := next(counter)) < len(jobs):
            path, offset = jobs[index]
            fd = os.open(path, os.O_RDONLY)
            try:
                total += os.preadv(fd, [buffer], offset)
            finally:
                os.close(fd)
        return total

    start = time.monotonic()
    with ThreadPoolExecutor(max_workers=threads) as pool:
        total = sum(pool.map(reader, buffers))
    return total / max(time.monotonic() - start, 1e-9)


H2D_PROBE = """
import torch, time
n = 1 << 30
host = torch.empty(n, dtype=torch.uint8).pin_memory()
dev = torch.empty(n, dtype=torch.uint8, device="cuda")
dev.copy_(host, non_blocking=True); torch.cuda.synchronize()
t = time.perf_counter()
for _ in range(5):
    dev.copy_(host, non_blocking=True)
torch.cuda.synchronize()
print(5 * n / (time.perf_counter() - t))
"""


def h2d_bandwidth() -> float | None:
    out = subprocess.run([sys.executable, "-c", H2D_PROBE], capture_output=True, text=True, timeout=300)
    try:
        return float(out.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return None


def _median_phases(runs: list[dict[str, float]]) -> dict[str, float]:
    keys = [k for k in runs[0] if all(k in r for r in runs)]
    return {k: statistics.median(r[k] for r in runs) for k in keys}


def run_bench(spec: ModelSpec, *, runs: int = 3, cold_runs: int | None = None, lazy_pages: bool = False,
              out_dir: Path | None = None, on_event: ProgressCallback | None = None) -> dict[str, Any]:
    timings = Timings(on_event)
    with timings.phase("preflight"):
        require_host(spec.engine)
        model_dir = resolve_model(spec)
    cache = Path(tempfile.mkdtemp(prefix="vsnap-bench-cache-"))
    cache_env = {"VLLM_CACHE_ROOT": str(cache)} if spec.engine == "vllm" else {}
    with timings.phase("cold start (fully cold)"):
        fully_cold = cold_start(spec, cache_env)
    warm = []
    for n in range(cold_runs or max(1, runs - 1)):
        with timings.phase(f"cold start (warm cache) #{n + 1}"):
            warm.append(cold_start(spec, cache_env))
    start = time.monotonic()
    with timings.phase("capture"):
        captured = capture_image(spec, force=True, env=cache_env)  # with the warm cache too
    capture_s = time.monotonic() - start
    restores, phases, sources = [], [], set()
    for n in range(runs):
        with timings.phase(f"restore to first token #{n + 1}"):
            start = time.monotonic()
            server = restore_image(captured.image_dir, port=0, lazy_pages=lazy_pages)
            first_token(server.url, spec.served_model_name)
            restores.append(time.monotonic() - start)
        phases.append({**server.timings, **{f"engine {k}": v for k, v in server.recovery.items() if k.endswith("_s")}})
        sources.add(server.weights_source)
        stop_server(server)
    image_files = [captured.image_dir / rel for rel in captured.manifest.files]
    weights_file = [p for p in image_files if p.parent.name == WEIGHTS_DIR]
    model_weights = [p for p in model_dir.rglob("*.safetensors")]
    # what a restore moves to the GPU: the image's weights file, else the model's safetensors
    weights = weights_file or model_weights
    weight_bytes = sum(p.stat().st_size for p in weights)
    disk_bw = read_bandwidth(image_files)
    h2d_bw = h2d_bandwidth() if spec.engine == "vllm" else None
    # CRIU reads the rest of the image; the weights stream at the slower of reading and copying
    rest_bytes = captured.image_bytes - (weight_bytes if weights_file else 0)
    floor = rest_bytes / disk_bw + weight_bytes / min(disk_bw, h2d_bw or disk_bw)
    facts = host_facts(spec.engine)
    cold_median = statistics.median(warm)
    restore_median = statistics.median(restores)
    record: dict[str, Any] = {
        "date": dt.date.today().isoformat(),
        "command": f"vsnap bench SPEC --runs {runs}" + (f" --cold-runs {cold_runs}" if cold_runs else "")
                   + (" --lazy-pages" if lazy_pages else ""),
        "lazy_pages": lazy_pages,
        "model": f"{spec.name} ({model_dir})",
        "gpu": facts.gpus[0]["name"] if facts.gpus else None,
        "versions": {"driver": facts.driver, "cuda": facts.cuda, "kernel": facts.kernel, "criu": facts.criu,
                     "python": facts.python, "torch": facts.torch, "vllm": facts.vllm, "vsnap": facts.vsnap},
        "runs": runs,
        "cold_start_fully_cold_s": fully_cold,
        "cold_start_warm_cache_s": warm,
        "cold_start_to_first_token_s_median": cold_median,
        "restore_to_first_token_s": restores,
        "restore_to_first_token_s_median": restore_median,
        "restore_spread_s": [min(restores), max(restores)],
        "speedup_vs_warm_cold_start": cold_median / restore_median,
        "capture_s": capture_s,
        "capture_phases": captured.timings,
        "image_bytes": captured.image_bytes,
        "weight_bytes": weight_bytes,
        "weights_source": sorted(str(x) for x in sources),
        "processes": captured.manifest.processes,
        "phases": _median_phases(phases),
        "floor_s": floor,
        "floor_inputs": {"image_read_bytes_per_s": disk_bw, "h2d_bytes_per_s": h2d_bw},
    }
    if out_dir is not None:
        write_record(record, out_dir, f"bench-{spec.name}-{record['date']}" + ("-lazy-pages" if lazy_pages else ""))
    return record


def write_record(record: dict[str, Any], out_dir: Path, stem: str) -> Path:
    """JSON, a markdown table and (when matplotlib is there) a plot."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{stem}.json").write_text(json.dumps(record, indent=2) + "\n")
    lines = [f"# {record['model']} on {record['gpu'] or 'CPU'} ({record['date']})", "",
             f"`{record['command']}`", "", "| | seconds |", "|---|---|",
             f"| cold start to first token, fully cold | {record['cold_start_fully_cold_s']:.2f} |",
             f"| cold start to first token, warm compile cache (median) | {record['cold_start_to_first_token_s_median']:.2f} |",
             f"| **restore to first token (median of {record['runs']})** | **{record['restore_to_first_token_s_median']:.2f}** "
             f"({record['restore_spread_s'][0]:.2f} to {record['restore_spread_s'][1]:.2f}) |",
             f"| speedup over the warm cold start | {record['speedup_vs_warm_cold_start']:.1f}x |",
             f"| capture | {record['capture_s']:.2f} |",
             f"| floor (image read + weights to device) | {record['floor_s']:.2f} |", "",
             f"Image {record['image_bytes'] / 1e9:.2f} GB, weights {record['weight_bytes'] / 1e9:.2f} GB "
             f"(restored from: {', '.join(record.get('weights_source') or ['?'])}).", "",
             "Restore phases (medians):", "", "| phase | seconds |", "|---|---|"]
    lines += [f"| {k} | {v:.3f} |" for k, v in record["phases"].items()]
    if record.get("processes"):
        lines += ["", "What fills the image (each process of the tree at the dump):", "",
                  "| process | anonymous memory | GPU memory before the CUDA checkpoint |", "|---|---|---|"]
        lines += [f"| `{proc['command'][:50]}` | {proc['anonymous_bytes'] / 1e6:.0f} MB | "
                  f"{proc['gpu_bytes'] / 1e6:.0f} MB |" if "gpu_bytes" in proc else
                  f"| `{proc['command'][:50]}` | {proc['anonymous_bytes'] / 1e6:.0f} MB | - |"
                  for proc in record["processes"]]
    png = out_dir / f"{stem}.png"
    if plot(record, png):
        lines += ["", f"![restore vs cold start]({png.name})"]
    (out_dir / f"{stem}.md").write_text("\n".join(lines) + "\n")
    return out_dir / f"{stem}.md"


def plot(record: dict[str, Any], png: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    labels = ["cold (fully)", "cold (warm cache)", "restore"]
    values = [record["cold_start_fully_cold_s"], record["cold_start_to_first_token_s_median"],
              record["restore_to_first_token_s_median"]]
    left.bar(labels, values, color=["#999", "#777", "#2a7"])
    left.set_ylabel("seconds to first token")
    left.set_title(record["model"].split(" ")[0])
    phases = {k: v for k, v in record["phases"].items() if not k.startswith("engine ")}
    bottom = 0.0
    for name, value in phases.items():
        right.bar(["restore"], [value], bottom=bottom, label=name)
        bottom += value
    right.axhline(record["floor_s"], color="k", linestyle="--", label="floor")
    right.set_ylabel("seconds")
    right.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1, 1))
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return True
