"""What `vsnap restore` and `vsnap activate` cost beyond their phases, old tree against new, interleaved.

    sudo python scripts/measure-cli-start.py --image IMAGE --src OLD/src --src NEW/src [--rounds 10]

Each round runs, for every --src in turn (the order alternates between rounds, so a machine that
slows down or speeds up weighs on both alike), in a new interpreter with PYTHONPATH=SRC from /:
the imports of the restore path (`import vsnap.cli` and the restore module, timed inside), `vsnap restore
/nonexistent --json` and `vsnap activate nosuch --json` (wall time: both fail in their first phase),
then IMAGE restored for real (`restore IMAGE --port 0 --detach --json`), a standby (`--standby
--detach`) and its activation (`activate ID --port 0 --json`), each stopped afterwards. Of a real
restore it records `command_start_s` (the command's own report: its start to its first phase), the
phases (`total_s`), the wall time, and the tail: from the progress line of the last phase (stderr)
to the process's exit (the record, the JSON document, detaching, the interpreter's exit). Medians
per tree; `--json-out FILE` keeps every sample. VSNAP_RUNTIME_DIR applies as usual.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

# the restore path's module by either layout (vsnap._restore before the rooms of session 12)
IMPORTS = ("import time, importlib, importlib.util; t = time.perf_counter(); import vsnap.cli; "
           "importlib.import_module('vsnap.ops.restore' if importlib.util.find_spec('vsnap.ops') else 'vsnap._restore'); "
           "print(time.perf_counter() - t)")


def run(src: str, args: list[str], timeout: float = 300) -> dict[str, Any]:
    """``python ARGS`` with src first on the path: wall time, the stdout, the tail after the last stderr line."""
    env = {**os.environ, "PYTHONPATH": src}
    start = time.monotonic()
    process = subprocess.Popen([sys.executable, *args], env=env, cwd="/", stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    last_line = [start]
    lines: list[str] = []

    def read_stderr() -> None:
        assert process.stderr is not None
        for line in process.stderr:
            last_line[0] = time.monotonic()
            lines.append(line)

    reader = threading.Thread(target=read_stderr)
    reader.start()
    out, _ = process.communicate(timeout=timeout)
    end = time.monotonic()
    reader.join()
    return {"wall": end - start, "tail": end - last_line[0], "stdout": out, "stderr": "".join(lines),
            "rc": process.returncode}


def vsnap(src: str, *args: str) -> dict[str, Any]:
    result = run(src, ["-m", "vsnap", *args])
    try:
        result["doc"] = json.loads(result["stdout"])
    except ValueError:
        result["doc"] = {}
    return result


def real(src: str, samples: dict[str, list[float]], name: str, *args: str) -> str:
    """A command that should succeed: its numbers into samples[name ...]; the instance it made."""
    result = vsnap(src, *args)
    doc = result["doc"]
    if result["rc"] != 0 or doc.get("kind") == "error":
        raise SystemExit(f"{' '.join(args)} failed ({result['rc']}): {result['stdout'][-500:]} "
                         f"{result['stderr'][-500:]}")
    samples.setdefault(f"{name} command_start_s", []).append(doc["command_start_s"])
    samples.setdefault(f"{name} phases", []).append(doc["total_s"])
    samples.setdefault(f"{name} wall", []).append(result["wall"])
    samples.setdefault(f"{name} tail", []).append(result["tail"])
    samples.setdefault(f"{name} wall - phases", []).append(result["wall"] - doc["total_s"])
    return str(doc["instance"])


def stop(src: str, instance: str) -> None:
    result = vsnap(src, "stop", instance, "--json")
    if result["rc"] != 0:
        raise SystemExit(f"vsnap stop {instance} failed: {result['stdout']} {result['stderr']}")


def one_round(src: str, image: str, samples: dict[str, list[float]]) -> None:
    samples.setdefault("imports (vsnap.cli and the restore module)", []).append(
        float(run(src, ["-c", IMPORTS])["stdout"]))
    samples.setdefault("restore /nonexistent --json, wall", []).append(
        vsnap(src, "restore", "/nonexistent", "--json")["wall"])
    samples.setdefault("activate nosuch --json, wall", []).append(vsnap(src, "activate", "nosuch", "--json")["wall"])
    stop(src, real(src, samples, "restore", "restore", image, "--port", "0", "--detach", "--json"))
    standby = real(src, samples, "standby", "restore", image, "--standby", "--detach", "--json")
    try:
        real(src, samples, "activate", "activate", standby, "--port", "0", "--json")
    finally:
        stop(src, standby)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--image", required=True)
    parser.add_argument("--src", action="append", required=True, help="a tree's src directory (give two)")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--json-out")
    args = parser.parse_args()
    samples: dict[str, dict[str, list[float]]] = {src: {} for src in args.src}
    for i in range(args.rounds):
        for src in (args.src if i % 2 == 0 else args.src[::-1]):
            one_round(src, args.image, samples[src])
        print(f"round {i + 1}/{args.rounds} done", file=sys.stderr)
    names = list(samples[args.src[0]])
    print(f"medians in ms, n={args.rounds} each; " + " | ".join(f"[{i}] {src}" for i, src in enumerate(args.src)))
    for name in names:
        medians = [statistics.median(samples[src][name]) * 1e3 for src in args.src]
        cells = "  ".join(f"[{i}] {m:7.1f}" for i, m in enumerate(medians))
        print(f"{name:<46} {cells}  diff {medians[-1] - medians[0]:+7.1f}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(samples, f, indent=1)


if __name__ == "__main__":
    main()
