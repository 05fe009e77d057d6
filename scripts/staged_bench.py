#!/usr/bin/env python3
"""`vsnap bench`'s measurements in steps, for a model whose bench does not fit in one call of the
GPU machine (600 s each; a 70B cold-starts in ~250 s and captures in ~300 s): each step keeps what
it measured in a state directory, and `report` writes the record from them.

    python scripts/staged_bench.py cold SPEC --state DIR        # a cold start: first completion, outputs, throughput
    python scripts/staged_bench.py capture SPEC --state DIR     # capture_image() into DIR/image
    python scripts/staged_bench.py restore SPEC --state DIR [--runs 3]
    python scripts/staged_bench.py standby SPEC --state DIR [--runs 3]   # standby, its memory, activation
    python scripts/staged_bench.py report SPEC --state DIR --out OUT
    python scripts/staged_bench.py clean SPEC --state DIR       # stop what is left, remove DIR
    python scripts/staged_bench.py all SPEC --state DIR --out OUT   # every step, in one process

It measures what `vsnap bench` does, with the bench's own code (ops.bench: cold_start, the
outputs, run_cli, first_token, compare_outputs): the spec's image and control directory are not
touched (the state directory holds the image, the control directory and the compile cache); a cold
start is the engine tree in serve mode, launch to first completion (the first with an empty
compile cache, later ones with it warm); a restore is a `vsnap restore --detach` command to the
first completion, from the command's start. Besides, after the first completion of the first cold
start and of the first restore: BENCH_PROMPTS x BENCH_TOKENS greedy outputs (compared) and a fixed
load (64 requests x 64 tokens, 32 in flight: tokens per second, compared). Keep DIR short (vLLM's
IPC sockets live under it): /tmp/sb.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from vsnap.host import verified
from vsnap.host.events import Timings
from vsnap.host.facts import host_facts
from vsnap.host.instances import running_instances
from vsnap.image.manifest import ENGINE_LOG
from vsnap.ops.bench.loadgen import run_throughput
from vsnap.ops.bench.outputs import bench_prompts, compare_outputs, first_token, outputs_of
from vsnap.ops.bench.record import cli_phases, engine_notes, median_phases
from vsnap.ops.bench.run import cold_start, measure_standby, run_cli, stop_instance
from vsnap.ops.capture import capture_image
from vsnap.spec.schema import ModelSpec, load_spec


def own_spec(spec: ModelSpec, state: Path) -> ModelSpec:
    return spec.model_copy(update={"image": str(state / "image"),
                                   "snapshot": spec.snapshot.model_copy(update={"control_dir": str(state / "c")})})


def cache_env(spec: ModelSpec, state: Path) -> dict[str, str]:
    return {"VLLM_CACHE_ROOT": str(state / "cache")} if spec.engine == "vllm" else {}


def save(state: Path, name: str, data: dict[str, Any]) -> None:
    (state / f"{name}.json").write_text(json.dumps(data, indent=1) + "\n")


def load(state: Path, name: str) -> dict[str, Any] | None:
    path = state / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def under_load(spec: ModelSpec, url: str) -> dict[str, Any]:
    """The outputs compared and the throughput, asked of one server after its first completion."""
    started = time.monotonic()
    outputs = outputs_of(spec)(url)
    outputs_s = time.monotonic() - started
    throughput = run_throughput(url, spec.served_model_name, bench_prompts())
    return {"outputs": outputs, "outputs_s": outputs_s, "throughput": throughput.summary()}


def step_cold(spec: ModelSpec, state: Path) -> dict[str, Any]:
    colds = load(state, "cold") or {"runs": []}
    fully_cold = not (state / "cache").exists() or not any((state / "cache").iterdir())
    (state / "cache").mkdir(mode=0o700, exist_ok=True)
    measured: dict[str, Any] = {}

    def while_up(url: str) -> list:
        if not colds["runs"]:  # the first cold start: what the restored server's are compared with
            measured.update(under_load(spec, url))
        return []

    cold = cold_start(spec, cache_env(spec, state), while_up)
    colds["runs"].append({"seconds": cold.seconds, "fully_cold": fully_cold, "instance": cold.instance_id, **measured})
    save(state, "cold", colds)
    return colds["runs"][-1]


def step_capture(spec: ModelSpec, state: Path) -> dict[str, Any]:
    (state / "cache").mkdir(mode=0o700, exist_ok=True)  # as the cold step makes it (a run without one)
    started = time.monotonic()
    captured = capture_image(spec, force=True, env=cache_env(spec, state))
    data = {"seconds": time.monotonic() - started, "timings": captured.timings, "image_bytes": captured.image_bytes,
            "sizes": captured.manifest.sizes, "image": str(captured.image_dir),
            "by_reference": os.environ.get("VSNAP_WEIGHTS_BY_REFERENCE", "") == "1",
            "engine_notes": engine_notes(captured.image_dir / ENGINE_LOG)}
    save(state, "capture", data)
    return data


def step_restore(spec: ModelSpec, state: Path, runs: int) -> dict[str, Any]:
    image = str(state / "image")
    restores = load(state, "restore") or {"runs": []}
    for _ in range(runs):
        started_ids: list[str] = []
        start = time.monotonic()
        doc = run_cli(["restore", image, "--port", "0", "--detach"], started_ids)
        try:
            first_token(doc["url"], spec.served_model_name)
            seconds = time.monotonic() - start
            run: dict[str, Any] = {"seconds": seconds, "phases": cli_phases(doc), "instance": doc["instance"],
                                   "weights_source": doc.get("weights_source"),
                                   "recovery": doc.get("recovery") or {}}  # the engine's report: oracle, pieces, rates
            if not restores["runs"]:
                run.update(under_load(spec, doc["url"]))
                run["engine_notes"] = engine_notes(Path(doc["engine_log"]))
        finally:
            for instance in started_ids:
                stop_instance(instance)
        restores["runs"].append(run)
        save(state, "restore", restores)
        print(f"restore to first completion: {seconds:.2f} s", flush=True)
    return restores


def step_standby(spec: ModelSpec, state: Path, runs: int) -> dict[str, Any]:
    """`vsnap bench`'s standby measurement: ``runs`` times a standby (`vsnap restore --standby
    --detach`, timed, its host memory), then `vsnap activate` to the first completion (timed)."""
    started: list[str] = []
    try:
        standby = measure_standby(str(state / "image"), spec, runs, started, Timings(), {})
    finally:
        for instance in started:
            stop_instance(instance)
    save(state, "standby", standby)
    print(f"standby: {standby['standby_restore_s_median']:.2f} s, host memory "
          f"{statistics.median(standby['standby_host_memory_bytes']) / 1e9:.2f} GB; activation to first completion "
          f"{standby['activation_to_first_token_s_median']:.2f} s", flush=True)
    return standby


def gpu_name(spec: ModelSpec) -> str | None:
    """The GPU the record was measured on, as `vsnap bench`'s record names it (host_facts); None
    without one."""
    gpus = host_facts(spec.engine).gpus
    return str(gpus[0]["name"]) if gpus else None


def step_report(spec: ModelSpec, state: Path, out: Path) -> str:
    cold, captured, restored = load(state, "cold"), load(state, "capture"), load(state, "restore")
    if not captured or not restored:
        sys.exit("report needs the capture and restore steps' results in the state directory")
    cold = cold or {"runs": []}  # a run without the cold step (device time ran short): said in the record
    first_cold, first_restore = (cold["runs"] or [None])[0], restored["runs"][0]
    seconds = [r["seconds"] for r in restored["runs"]]
    outputs = compare_outputs(first_cold["outputs"], first_restore["outputs"]) if first_cold else None
    cold_tps = first_cold["throughput"]["tokens_per_s"] if first_cold else None
    restored_tps = first_restore["throughput"]["tokens_per_s"]
    record = {
        "name": spec.name, "date": dt.date.today().isoformat(), "engine": spec.engine, "model": spec.model,
        "gpu": gpu_name(spec), "serve": dict(spec.serve), "cold_s": [r["seconds"] for r in cold["runs"]],
        "cold_fully_cold": [r["fully_cold"] for r in cold["runs"]], "capture": captured,
        "restore_s": seconds, "restore_median_s": statistics.median(seconds),
        "phases_median": median_phases([r["phases"] for r in restored["runs"]]),
        "oracle_max_abs_diff": [r.get("recovery", {}).get("oracle_max_abs_diff") for r in restored["runs"]],
        "weights_gb_per_s": [r.get("recovery", {}).get("weights_gb_per_s") for r in restored["runs"]],
        "outputs": outputs, "throughput": {"cold": first_cold["throughput"] if first_cold else None,
                                           "restored": first_restore["throughput"],
                                           "restored_over_cold": restored_tps / cold_tps if cold_tps else None},
        "engine_notes": {"capture": captured["engine_notes"], "restore": first_restore.get("engine_notes", [])},
        "standby": load(state, "standby"),  # None without the standby step
    }
    standby = record["standby"]
    out.mkdir(parents=True, exist_ok=True)
    stem = f"staged-bench-{spec.name}-{record['date']}"
    (out / f"{stem}.json").write_text(json.dumps(record, indent=1) + "\n")
    lines = [f"# staged bench: {spec.name} on {record['gpu'] or 'CPU'} ({record['date']})", "",
             "| measure | value |", "|---|---|",
             *(f"| cold start to first completion #{n + 1}{' (fully cold)' if f else ''} | {s:.2f} s |"
               for n, (s, f) in enumerate(zip(record["cold_s"], record["cold_fully_cold"]))),
             *([] if first_cold else ["| cold start | not measured in this run (no cold step) |"]),
             f"| capture | {captured['seconds']:.1f} s, image {captured['image_bytes'] / 1e9:.2f} GB"
             f"{' (weights by reference)' if captured['by_reference'] else ''} |",
             f"| restore to first completion | median **{record['restore_median_s']:.2f} s** "
             f"({', '.join(f'{s:.2f}' for s in seconds)}) |",
             *([f"| speedup over the first cold start | {record['cold_s'][0] / record['restore_median_s']:.1f}x |",
                f"| outputs, {outputs['prompts']} prompts x their tokens | {outputs['mismatched_prompts']} differ, "
                f"largest logprob difference {outputs['max_logprob_diff']:.3g} |",
                f"| throughput (64 x 64 tokens, 32 in flight) | cold {cold_tps:.0f} tok/s, restored "
                f"{restored_tps:.0f} tok/s ({record['throughput']['restored_over_cold'] or 0:.3f}) |"]
               if first_cold and outputs else
               [f"| throughput after restore (64 x 64 tokens, 32 in flight) | {restored_tps:.0f} tok/s |"]),
             *([f"| standby (`vsnap restore --standby`), its host memory | median "
                f"{standby['standby_restore_s_median']:.2f} s, "
                f"{statistics.median(standby['standby_host_memory_bytes']) / 1e9:.2f} GB |",
                f"| standby activation to first completion | median "
                f"**{standby['activation_to_first_token_s_median']:.2f} s** "
                f"({', '.join(f'{s:.2f}' for s in standby['activation_to_first_token_s'])}) |"] if standby else []), "",
             f"Oracle at each restore (3 prompts x 8 tokens, top-5), largest logprob difference: "
             f"{', '.join('not recorded' if d is None else f'{d:.3g}' for d in record['oracle_max_abs_diff'])}"
             + ("" if all(g is None for g in record["weights_gb_per_s"]) else
                f"; weights GB/s: {', '.join('-' if g is None else f'{g:.1f}' for g in record['weights_gb_per_s'])}")
             + ".", "",
             "Restore phases (median): " + ", ".join(f"{k} {v:.2f} s" for k, v in record["phases_median"].items()
                                                    if isinstance(v, (int, float))), ""]
    text = "\n".join(lines)
    (out / f"{stem}.md").write_text(text)
    return text


def step_clean(state: Path) -> None:
    """Stop every instance of the state's image (restores and standbys, those a step killed at the
    call's limit left behind too: their records name the image), then remove the state."""
    image = os.path.realpath(state / "image")
    for record in running_instances():
        if os.path.realpath(record.image) == image:
            stop_instance(record.id)
    verified.forget(state / "image")
    shutil.rmtree(state, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step", choices=["cold", "capture", "restore", "standby", "report", "clean", "all"])
    parser.add_argument("spec", type=Path)
    parser.add_argument("--state", type=Path, required=True)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args()
    state = args.state.absolute()
    if args.step == "clean":
        step_clean(state)
        return
    state.mkdir(mode=0o700, parents=True, exist_ok=True)
    spec = own_spec(load_spec(args.spec), state)
    if args.step in ("cold", "all"):
        print(json.dumps({k: v for k, v in step_cold(spec, state).items() if k != "outputs"}), flush=True)
    if args.step in ("capture", "all"):
        print(json.dumps({k: v for k, v in step_capture(spec, state).items() if k != "engine_notes"}), flush=True)
    if args.step in ("restore", "all"):
        step_restore(spec, state, args.runs)
    if args.step in ("standby", "all"):
        step_standby(spec, state, args.runs)
    if args.step in ("report", "all"):
        print(step_report(spec, state, args.out))


if __name__ == "__main__":
    main()
