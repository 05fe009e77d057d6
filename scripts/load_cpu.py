"""Load test of a restored CPU server: concurrent completions on loopback for a fixed time.

    .venv/bin/python scripts/load_cpu.py [--concurrency 8] [--seconds 30] [--out docs/benchmarks]

Captures the CPU engine, restores it on a free loopback port, runs the load, stops the server
and writes load-cpu-<date>.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import tempfile
from pathlib import Path

from vsnap import capture_image, restore_image, stop_server
from vsnap.ops.bench.loadgen import run_load
from vsnap.spec.schema import ModelSpec


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="vsnap-load-"))
    spec = ModelSpec(name="load-cpu", engine="cpu", image=str(work / "images" / "load-cpu"),
                     snapshot={"control_dir": str(work / "control")})
    server = restore_image(capture_image(spec).image_dir, port=0)
    try:
        runs = [run_load(server.url, concurrency=c, seconds=args.seconds).summary() for c in args.concurrency]
    finally:
        stop_server(server)
    record = {"date": dt.date.today().isoformat(),
              "command": f"scripts/load_cpu.py --concurrency {' '.join(map(str, args.concurrency))} --seconds {args.seconds:g}",
              "server": "restored vsnap cpu engine (cpu-tiny-v1), 4-token greedy completions, loopback",
              "runs": runs}
    path = args.out / f"load-cpu-{record['date']}.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"{'conc':>4} {'req':>6} {'err':>4} {'rps':>7} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8}")
    for r in runs:
        print(f"{r['concurrency']:>4} {r['requests']:>6} {r['errors']:>4} {r['throughput_rps']:>7.1f} "
              f"{r['latency_p50_s'] * 1e3:>8.1f} {r['latency_p90_s'] * 1e3:>8.1f} {r['latency_p99_s'] * 1e3:>8.1f}")
    print(f"written to {path}")


if __name__ == "__main__":
    main()
