#!/usr/bin/env python3
"""CRIU's restore of a tree shaped like vsnap's vLLM trees, one CRIU build against another.

A root process holding ROOT MiB (the API server's heap) and a child holding CHILD MiB: half in
one dense mapping (the CUDA checkpoint's host copy of device memory), half in 64 MiB mappings
with one page in 16 never written (heaps: VMAs the image does not cover whole). The tree is
dumped once; restores alternate between the CRIU builds given; each restore is timed (the
`criu restore` command) and profiled from its log (scripts/criu-restore-profile.py).

    python3 scripts/bench-criu-restore.py --root-mib 700 --child-mib 2800 --runs 3 \\
        --criu pristine=/var/tmp/criu-pristine/criu --criu patched=/usr/local/bin/criu \\
        --out docs/benchmarks/criu-restore-cpu-DATE
(a pristine build: scripts/criu/install.sh's source tree built without scripts/criu/patches)
Run as root. Writes OUT.json and OUT.md.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))
from vsnap.host.criu.options import DumpOptions, RestoreOptions  # noqa: E402
from vsnap.host.criu.runner import CriuRunner  # noqa: E402

_spec = importlib.util.spec_from_file_location("criu_restore_profile", REPO / "scripts" / "criu-restore-profile.py")
assert _spec and _spec.loader
profile_module = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = profile_module  # its dataclass looks its module up
_spec.loader.exec_module(profile_module)

TREE = r"""
import mmap, os, signal, sys, time
ROOT, CHILD, ready = int(sys.argv[1]) << 20, int(sys.argv[2]) << 20, sys.argv[3]
PAGE, CHUNK = mmap.PAGESIZE, 64 << 20
keep = []
def dense(size):
    m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    block = os.urandom(1 << 20)
    for off in range(0, size, 1 << 20):
        m[off:off + (1 << 20)] = block
    keep.append(m)
def holed(size):
    for _ in range(size // CHUNK):
        m = mmap.mmap(-1, CHUNK, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        page = os.urandom(PAGE)
        for off in range(0, CHUNK, PAGE):
            if (off // PAGE) % 16:
                m[off:off + PAGE] = page
        keep.append(m)
if os.fork() == 0:
    keep.append(mmap.mmap(-1, 6 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS))  # another address
    dense(CHILD // 2)
    holed(CHILD // 2)
    open(ready + ".child", "w").close()
    while True:
        signal.pause()
holed(ROOT)
while not os.path.exists(ready + ".child"):
    time.sleep(0.05)
open(ready, "w").close()
while True:
    signal.pause()
"""


VMSTAT = ("pgfault", "pgmajfault")


def vmstat() -> dict[str, int]:
    counters = dict(line.split() for line in Path("/proc/vmstat").read_text().splitlines())
    return {k: int(counters.get(k, 0)) for k in VMSTAT}


def wait_gone(pids: list[int], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while any(os.path.exists(f"/proc/{p}") for p in pids):
        if time.monotonic() > deadline:
            raise SystemExit(f"pids {pids} still there")
        time.sleep(0.02)


def tree_pids(root: int) -> list[int]:
    children = Path(f"/proc/{root}/task/{root}/children").read_text().split()
    return [root, *map(int, children)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root-mib", type=int, default=700)
    ap.add_argument("--child-mib", type=int, default=2800)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--criu", action="append", required=True, help="NAME=PATH of a criu binary")
    ap.add_argument("--out", required=True, help="path without suffix for OUT.json and OUT.md")
    args = ap.parse_args()
    variants = []
    for item in args.criu:
        name, _, path = item.partition("=")
        variants.append((name, Path(path)))
    work = Path(tempfile.mkdtemp(prefix="vsnap-bench-criu-", dir="/var/tmp"))
    images = work / "images"
    images.mkdir()
    ready = work / "ready"
    root = subprocess.Popen([sys.executable, "-c", TREE, str(args.root_mib), str(args.child_mib), str(ready)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, cwd="/")
    while not ready.exists():
        if root.poll() is not None:
            raise SystemExit("the tree died before it was ready")
        time.sleep(0.1)
    pids = tree_pids(root.pid)
    CriuRunner.locate().dump(DumpOptions(pid=root.pid, images_dir=images, log_file=work / "dump.log"), timeout_s=600)
    root.wait(timeout=30)
    wait_gone(pids)
    image_bytes = sum(f.stat().st_size for f in images.glob("pages-*.img"))
    for f in images.iterdir():  # in the page cache, as an image is after capture or a first restore
        with f.open("rb") as pages:
            while pages.read(64 << 20):  # in pieces: pages-*.img is GBs
                pass
    runs: list[dict] = []
    for n in range(args.runs):
        for name, path in variants:
            log = work / f"restore-{name}-{n}.log"
            runner = CriuRunner(path)
            options = RestoreOptions(images_dir=images, work_dir=work, log_file=log, pidfile=work / "restore.pid")
            counters = vmstat()
            start = time.monotonic()
            top = runner.restore(options, timeout_s=600)
            seconds = time.monotonic() - start
            after = vmstat()
            restored = tree_pids(top)
            for pid in restored:
                os.kill(pid, signal.SIGKILL)
            wait_gone(restored)
            prof = profile_module.profile(log.read_text(errors="replace").splitlines())
            runs.append({"variant": name, "run": n, "criu_restore_s": round(seconds, 3),
                         "log_end_s": prof["log_end_s"], "tasks": prof["tasks"],
                         "vmstat": {k: after[k] - counters[k] for k in VMSTAT}})
    summary = {}
    for name, _ in variants:
        mine = [r for r in runs if r["variant"] == name]
        summary[name] = {
            "criu_restore_s_median": round(statistics.median(r["criu_restore_s"] for r in mine), 3),
            "criu_restore_s": [r["criu_restore_s"] for r in mine],
            # what the restore took beyond the largest task's own page reads (which vary most
            # between runs on a shared machine): the serial part the patch is about
            "beyond_largest_reads_s_median": round(statistics.median(
                r["criu_restore_s"] - max(t["seconds"] for t in r["tasks"]) for r in mine), 3),
            "reads_gb_per_s_median": {
                str(t["pid"]): round(statistics.median(
                    x["gb_per_s"] for r in mine for x in r["tasks"] if x["pid"] == t["pid"]), 2)
                for t in mine[0]["tasks"] if t["bytes"] > 1 << 26},
            "root_reads_overlap_child": all(
                min(t["first_s"] for t in r["tasks"] if t["pid"] == root.pid)
                < max(t["last_s"] for t in r["tasks"] if t["pid"] != root.pid) for r in mine),
        }
    record = {
        "what": "criu restore of a vLLM-shaped tree (scripts/bench-criu-restore.py)",
        "command": " ".join(sys.argv),
        "host": {"cpus": os.cpu_count(), "kernel": platform.release(),
                 "thp": Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip()},
        "tree": {"root_mib": args.root_mib, "child_mib": args.child_mib, "image_pages_gb": round(image_bytes / 1e9, 2),
                 "root_pid": root.pid},
        "variants": {name: str(path) for name, path in variants},
        "summary": summary, "runs": runs,
    }
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
    lines = [f"# criu restore, {record['tree']['image_pages_gb']} GB of pages "
             f"(root {args.root_mib} MiB, child {args.child_mib} MiB), {os.cpu_count()} CPUs, THP {record['host']['thp']}",
             "", f"`{record['command']}`", "",
             "| variant | criu restore (median) | runs | beyond the largest task's reads (median) | page reads GB/s by pid (median) | root reads beside the child |",
             "|---|---|---|---|---|---|"]
    for name, s in summary.items():
        lines.append(f"| {name} | {s['criu_restore_s_median']:.3f} s | {', '.join(f'{x:.3f}' for x in s['criu_restore_s'])} "
                     f"| {s['beyond_largest_reads_s_median']:.3f} s "
                     f"| {', '.join(f'{k}: {v}' for k, v in s['reads_gb_per_s_median'].items())} | {s['root_reads_overlap_child']} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    subprocess.run(["rm", "-rf", str(work)], check=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
