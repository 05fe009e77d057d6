"""Benchmark the CPU engine: cold start to first token vs restore to first token, in one run.

    .venv/bin/python scripts/bench_cpu.py [--runs 5] [--out docs/benchmarks]

Cold start: launch the engine tree (same code, same oracle work), activate it at once, wait until
it serves, send one completion. Restore: `restore_image()` of an image captured in the same run,
then the same completion. Writes cpu-<date>.json and appends nothing else; prints a table.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

from vsnap import _control as control
from vsnap._capture import capture_image, launch_config, resolve_model, tree_environment, wait_ready
from vsnap._control import Activation
from vsnap._host import host_facts
from vsnap._instances import new_instance_dir
from vsnap._shm import instance_shm_dir, remove_instance_shm
from vsnap._proctree import kill_tree, launch_tree
from vsnap._restore import _wait_status, hand_over_listener, restore_image, stop_server
from vsnap._spec import ModelSpec


def first_token(url: str) -> None:
    body = json.dumps({"prompt": "Hello", "max_tokens": 1}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        assert len(json.load(response)["choices"][0]["token_ids"]) == 1


def cold_start(spec: ModelSpec, work: Path) -> float:
    control_dir = control.ensure_private_dir(work / "cold")
    instance_id, instance = new_instance_dir(control_dir, "cold")
    control.write_message(instance, control.LAUNCH, launch_config(spec, resolve_model(spec)))
    heartbeat = control.OwnerHeartbeat(instance).start()
    start = time.monotonic()
    shm = instance_shm_dir(instance_id)
    tree = launch_tree(control_dir, instance, shm, tree_environment(control_dir, instance))
    try:
        wait_ready(tree, instance, 300)
        control.write_message(instance, control.ACTIVATION, Activation(host="127.0.0.1", port=0))
        _wait_status(instance, tree.root_pid, ("validated",), "recover", instance / control.ENGINE_LOG)
        status = hand_over_listener(instance, tree.root_pid, "127.0.0.1", 0, instance / control.ENGINE_LOG)
        first_token(f"http://127.0.0.1:{status.detail['port']}")
        return time.monotonic() - start
    finally:
        heartbeat.stop()
        kill_tree(tree.root_pid)
        tree.unshare.wait()
        remove_instance_shm(shm)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="vsnap-bench-"))
    spec = ModelSpec(name="bench-cpu", engine="cpu", image=str(work / "images" / "bench-cpu"),
                     snapshot={"control_dir": str(work / "control")})
    resolve_model(spec)  # written once, outside the timings
    colds = [cold_start(spec, work) for _ in range(args.runs)]
    start = time.monotonic()
    captured = capture_image(spec)
    capture_s = time.monotonic() - start
    restores, phases = [], []
    for _ in range(args.runs):
        start = time.monotonic()
        server = restore_image(captured.image_dir, port=0)
        first_token(server.url)
        restores.append(time.monotonic() - start)
        phases.append({**server.timings, **{f"engine {k}": v for k, v in server.recovery.items() if k.endswith("_s")}})
        stop_server(server)
    facts = host_facts("cpu")
    record = {
        "date": dt.date.today().isoformat(),
        "command": f"scripts/bench_cpu.py --runs {args.runs}",
        "model": "vsnap cpu-tiny-v1 (4 layers, d=256, 4.3M params, byte vocab)",
        "gpu": None,
        "host": {"cpu": platform.processor() or platform.machine(), "cores": __import__("os").cpu_count(),
                 "kernel": facts.kernel, "criu": facts.criu, "python": facts.python, "torch": facts.torch,
                 "vsnap": facts.vsnap},
        "runs": args.runs,
        "cold_start_to_first_token_s": colds,
        "cold_start_to_first_token_s_median": statistics.median(colds),
        "restore_to_first_token_s": restores,
        "restore_to_first_token_s_median": statistics.median(restores),
        "speedup_median": statistics.median(colds) / statistics.median(restores),
        "capture_s": capture_s,
        "capture_phases": captured.timings,
        "image_bytes": captured.image_bytes,
        "phases": {k: statistics.median(p[k] for p in phases) for k in phases[0]},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"cpu-{record['date']}.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"{'cold start to first token (median)':<40} {record['cold_start_to_first_token_s_median']:8.3f} s")
    print(f"{'restore to first token (median)':<40} {record['restore_to_first_token_s_median']:8.3f} s")
    print(f"{'  spread (min..max)':<40} {min(restores):.3f}..{max(restores):.3f} s")
    for name, value in record["phases"].items():
        print(f"{'  ' + name:<40} {value:8.3f} s")
    print(f"{'capture':<40} {capture_s:8.3f} s")
    print(f"{'image':<40} {captured.image_bytes / 1e6:8.1f} MB")
    print(f"written to {path}")


if __name__ == "__main__":
    main()
