#!/usr/bin/env python3
"""Where a CRIU restore's time went, from its log (-v4): each task's page reads (the restorer's
preadv calls, or with our patch 0002 its reads on several threads: bytes, seconds, GB/s,
threads, when they ran).

    python3 scripts/criu-restore-profile.py RESTORE.log [--json]
"""
from __future__ import annotations

import json
import re
import sys
from dataclasses import asdict, dataclass, field

STAMP = re.compile(r"^\((\d+\.\d+)\)\s+(?:pie: )?(\d+): (.*)$")


@dataclass
class TaskReads:
    pid: int
    bytes: int = 0
    seconds: float = 0.0
    first_s: float | None = None
    last_s: float = 0.0
    calls: int = 0
    threads: int = 1
    _started: float | None = field(default=None, repr=False)


def _count(task: TaskReads, t: float) -> None:
    assert task._started is not None
    task.seconds += t - task._started
    task.last_s = t
    task.calls += 1
    task._started = None


def profile(lines: list[str]) -> dict:
    tasks: dict[int, TaskReads] = {}
    end_s = 0.0
    for line in lines:
        m = STAMP.match(line)
        if not m:
            continue
        t, pid, text = float(m.group(1)), int(m.group(2)), m.group(3)
        end_s = max(end_s, t)
        task = tasks.setdefault(pid, TaskReads(pid))
        if text.startswith("Preadv ") or text.startswith("vsnap: reading "):  # patch 0002 reads on threads
            task._started = t
            task.first_s = t if task.first_s is None else task.first_s
        elif text.startswith("`- returned ") and task._started is not None:
            task.bytes += int(text.split()[2])
            _count(task, t)
        elif text.startswith("vsnap: ") and " MiB of pages read on " in text and task._started is not None:
            task.bytes += int(text.split()[1]) << 20
            task.threads = int(text.split()[-2])
            _count(task, t)
    reads = []
    for task in tasks.values():
        if task.calls:
            row = asdict(task)
            row.pop("_started")
            row["gb_per_s"] = round(task.bytes / 1e9 / task.seconds, 2) if task.seconds else None
            reads.append(row)
    reads.sort(key=lambda r: r["first_s"])
    return {"log_end_s": end_s, "tasks": reads}


def main() -> int:
    if len(sys.argv) < 2:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    with open(sys.argv[1], errors="replace") as f:
        result = profile(f.read().splitlines())
    if "--json" in sys.argv:
        print(json.dumps(result, indent=1))
        return 0
    print(f"{'pid':>6} {'GB':>6} {'reads s':>8} {'GB/s':>6} {'threads':>7} {'from':>7} {'to':>7}")
    for r in result["tasks"]:
        print(f"{r['pid']:>6} {r['bytes'] / 1e9:>6.2f} {r['seconds']:>8.3f} {r['gb_per_s'] or 0:>6.2f} "
              f"{r['threads']:>7} {r['first_s']:>7.3f} {r['last_s']:>7.3f}")
    print(f"log ends at {result['log_end_s']:.3f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
