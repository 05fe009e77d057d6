"""run_bench(): cold start vs restore to first token, in one run, with the breakdown and the floor.

* cold start to first token: the engine tree launched in "serve" mode (the same code, without the
  snapshot work), from launch to the first HTTP completion; "fully cold" with an empty compile
  cache, then "warm cache" reusing it (vLLM; the cpu engine has no compile cache);
* capture: `capture_image()` of the spec, with the warm cache, into an image of the bench's own;
* restore to first token: a `vsnap restore --detach` command (a new interpreter, as a user runs it)
  plus the first completion, ``runs`` times;
* standby (unless turned off): `vsnap restore --standby --detach` (its time and host memory), then
  `vsnap activate` plus the first completion, ``runs`` times;
* equal outputs (outputs.py): BENCH_PROMPTS prompts x BENCH_TOKENS greedy tokens, sent one at a
  time to the fully cold start, the first warm cold start and the first restore, token ids and
  logprobs compared (restored vs cold is the result; cold vs cold says how far the engine agrees
  with itself);
* floor (floor.py): the image's bytes over this host's measured bandwidths;
* the record (record.py): JSON, markdown and a plot in ``out_dir``.

This module is the orchestration; a cold start boots its tree as a capture does (ops/tree), in
"serve" mode.

The spec's own image and control directory are never touched: the bench works in two private
directories beside them (``.<image name>.bench-XXXX`` next to the image: the bench image and the
compile cache; ``.<control name>.bench-XXXX`` next to the control directory: the trees' control
and instance directories) and removes both, every tree it started, every restored server and
every /dev/shm directory on every exit path. A failed bench first copies its engine and CRIU
logs to ``out_dir`` (the error then names the copy).
"""

from __future__ import annotations

import datetime as dt
import json
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from vsnap.engine.adapters.vllm.serve_args import serves_tls
from vsnap.host import verified
from vsnap.host.cleanup import Cleanup
from vsnap.host.events import ProgressCallback, Timings
from vsnap.host.facts import host_facts, require_host, vllm_device
from vsnap.host.instances import running_instances
from vsnap.host.trust import copy_no_follow, make_trusted_dirs
from vsnap.image.manifest import ENGINE_LOG
from vsnap.image.store import check_parent
from vsnap.ops.bringup import handed_over_listener
from vsnap.ops.capture import capture_image
from vsnap.ops.stop import stop_server
from vsnap.ops.tree import boot_tree, launch_config, new_tree_instance, resolve_model
from vsnap.protocol.errors import EngineError, UnsupportedOption, VsnapError
from vsnap.spec.schema import ModelSpec

from .floor import restore_floor
from .outputs import Completion, first_token, outputs_of
from .record import BenchOptions, Measured, bench_record, cli_phases, engine_notes, standby_record, write_record

CLI_TIMEOUT_S = 900  # one `vsnap restore` / `vsnap activate` the bench runs


@dataclass(frozen=True)
class BenchDirs:
    """What the bench works in; both directories are removed when it ends."""

    image_work: Path  # beside the spec's image: the bench image, the compile cache
    control_work: Path  # beside the spec's control directory: control and instance directories

    @property
    def image(self) -> Path:
        return self.image_work / "image"

    @property
    def cache(self) -> Path:
        return self.image_work / "cache"

    @property
    def control(self) -> Path:
        return self.control_work / "c"  # short: vLLM's IPC sockets live under it

    @property
    def instances(self) -> Path:
        return Path(f"{self.control}.instances")


def make_bench_dirs(spec: ModelSpec, cleanup: Cleanup) -> BenchDirs:
    """Two new private directories beside the spec's image and control directory, each removed on exit."""
    check_parent(spec.image_dir)
    image_work = Path(tempfile.mkdtemp(prefix=f".{spec.image_dir.name}.bench-", dir=spec.image_dir.parent))
    cleanup.on_exit(shutil.rmtree, image_work, True)
    make_trusted_dirs(spec.control_dir.parent)  # never through a directory or link someone else owns
    control_work = Path(tempfile.mkdtemp(prefix=f".{spec.control_dir.name}.bench-", dir=spec.control_dir.parent))
    cleanup.on_exit(shutil.rmtree, control_work, True)
    dirs = BenchDirs(image_work, control_work)
    dirs.cache.mkdir(mode=0o700)
    return dirs


def bench_spec(spec: ModelSpec, dirs: BenchDirs) -> ModelSpec:
    """The spec with the bench's own image and control directory."""
    return spec.model_copy(update={"image": str(dirs.image),
                                   "snapshot": spec.snapshot.model_copy(update={"control_dir": str(dirs.control)})})


@dataclass(frozen=True)
class ColdStart:
    seconds: float  # launch to the first token
    outputs: list[Completion]  # what while_up returned, if it was given
    instance_id: str


def cold_start(spec: ModelSpec, env_extra: dict[str, str],
               while_up: Callable[[str], list[Completion]] | None = None) -> ColdStart:
    """Launch -> first token of a plain engine (no snapshot work); then ``while_up(url)``, if given,
    while it still serves. The tree, its /dev/shm directory and (unless it failed) its instance
    directory are released."""
    control_dir = spec.control_dir
    with Cleanup() as cleanup:
        instance = new_tree_instance(control_dir, "cold", cleanup)
        launch = launch_config(spec, resolve_model(spec), mode="serve")
        booted = boot_tree(control_dir, instance, launch, cleanup, env=env_extra)
        with handed_over_listener(instance.work, booted.tree.identity, "127.0.0.1", 0, booted.log) as port:
            url = f"http://127.0.0.1:{port}"
            first_token(url, spec.served_model_name)
            seconds = time.monotonic() - booted.launched_at
            return ColdStart(seconds, while_up(url) if while_up is not None else [], instance.id)


def keep_evidence(error: BaseException, dirs: BenchDirs, out_dir: Path | None, stem: str) -> None:
    """Before the bench's directories go: copy every log in them to OUT_DIR/STEM-failed/ and
    point the error at the copy of the log it names."""
    if out_dir is None:
        return
    kept = out_dir / f"{stem}-failed"
    copies: dict[str, Path] = {}
    for root in (dirs.control_work, dirs.image_work):
        for log in sorted(root.rglob("*.log")):
            if log.is_symlink() or not log.is_file() or dirs.cache in log.parents:
                continue
            copy = kept / "-".join(log.relative_to(root).parts[-2:])
            try:
                make_trusted_dirs(kept)
                copy.unlink(missing_ok=True)  # an earlier failure's copy (the name, never a link's target)
                copy_no_follow(log, copy)
            except (OSError, VsnapError):
                continue
            copies[str(log)] = copy
    if isinstance(error, VsnapError) and error.log_path and str(error.log_path) in copies:
        error.log_path = str(copies[str(error.log_path)])


def run_bench(spec: ModelSpec, *, runs: int = 3, cold_runs: int | None = None, lazy_pages: bool = False,
              standby: bool = True, out_dir: Path | None = None,
              on_event: ProgressCallback | None = None) -> dict[str, Any]:
    """Measure ``spec`` as the module says, in directories of the bench's own; the record (also
    written to ``out_dir`` when given). A failure keeps the logs there first (keep_evidence)."""
    options = BenchOptions(runs, cold_runs, lazy_pages, standby)
    timings = Timings(on_event)
    model_dir = _preflight(spec, out_dir, timings)
    stem = f"bench-{spec.name}-{dt.date.today().isoformat()}" + ("-lazy-pages" if lazy_pages else "")
    outputs = outputs_of(spec)
    with Cleanup() as cleanup:
        dirs = make_bench_dirs(spec, cleanup)
        own = bench_spec(spec, dirs)
        cleanup.on_exit(verified.forget, dirs.image)  # capture and restores remember what they hashed
        started: list[str] = []  # instances the bench's `vsnap restore` commands started
        cleanup.on_exit(stop_all, started)
        try:
            record = _measure(spec, own, dirs, model_dir, options, timings, outputs, started)
        except BaseException as error:
            keep_evidence(error, dirs, out_dir, stem)
            raise
    record["work"] = {**record["work"], "image_work": str(dirs.image_work), "control_work": str(dirs.control_work),
                      "removed": not dirs.image_work.exists() and not dirs.control_work.exists()}
    if out_dir is not None:
        write_record(record, out_dir, stem)
    return record


def _preflight(spec: ModelSpec, out_dir: Path | None, timings: Timings) -> Path:
    """What refuses the bench before minutes of measuring; the model directory."""
    if spec.engine == "vllm":
        if serves_tls(dict(spec.serve)):
            raise UnsupportedOption("serve.ssl_*", "vsnap bench speaks plain HTTP to the servers it measures",
                                    hint="bench a copy of the spec without serve.ssl_keyfile and serve.ssl_certfile")
    with timings.phase("preflight"):
        if out_dir is not None:
            make_trusted_dirs(out_dir)  # before minutes of measuring: the record must be writable safely
        require_host(spec.engine)
        return resolve_model(spec)


def stop_all(started: list[str]) -> None:
    """Stop every instance still in ``started`` (the bench's own, newest first)."""
    while started:
        stop_instance(started.pop())


def run_cli(args: list[str], started: list[str]) -> dict[str, Any]:
    """``vsnap ARGS --json`` in a new interpreter (what a user's command costs, its start included);
    its JSON document. The instance it names is added to ``started`` (the bench stops them all)."""
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "vsnap", *args, "--json"], capture_output=True, text=True,
                         timeout=CLI_TIMEOUT_S, cwd="/")  # from /: nothing is imported from the caller's directory
    wall = time.monotonic() - start
    try:
        doc = dict(json.loads(out.stdout))
    except ValueError:
        doc = {}
    if doc.get("instance"):
        started.append(str(doc["instance"]))
    if out.returncode != 0 or doc.get("kind") == "error":
        raise EngineError("bench", str(doc.get("error", "CommandFailed")),
                          f"vsnap {args[0]} exited {out.returncode}: {doc.get('message') or out.stderr.strip()[-300:]}",
                          log_path=doc.get("log_path"))
    # what the command cost beyond its phases: the interpreter's start and imports (the command's own
    # command_start_s), then printing and exit
    doc["cli_overhead_s"] = wall - float(doc.get("total_s") or 0.0)
    return doc


def stop_instance(instance_id: str) -> None:
    """Stop one instance the bench started, by its record (nothing if it is already gone)."""
    for record in running_instances():
        if record.id == instance_id:
            stop_server(record)


def _measure(spec: ModelSpec, own: ModelSpec, dirs: BenchDirs, model_dir: Path, options: BenchOptions,
             timings: Timings, outputs: Callable[[str], list[Completion]], started: list[str]) -> dict[str, Any]:
    """Cold starts, the capture, the restores, the standbys, the floor, in that order; the record
    of them (bench_record)."""
    cache_env = {"VLLM_CACHE_ROOT": str(dirs.cache)} if spec.engine == "vllm" else {}
    cold = _cold_starts(own, cache_env, options, timings, outputs)
    start = time.monotonic()
    with timings.phase("capture"):
        captured = capture_image(own, env=cache_env)  # with the warm cache too
    capture_s = time.monotonic() - start
    notes = {"capture": engine_notes(captured.image_dir / ENGINE_LOG)}
    image = str(captured.image_dir)
    restores = _restores(image, spec, options, started, timings, outputs, notes)
    standbys = measure_standby(image, spec, options.runs, started, timings, notes) if options.standby else None
    image_files = [captured.image_dir / rel for rel in captured.manifest.files]
    vllm_on = vllm_device() if spec.engine == "vllm" else None
    floor = restore_floor(image_files, captured.image_bytes, model_dir, vllm_on)
    facts = host_facts(spec.engine)
    measured = Measured(
        cold_s=[c.seconds for c in cold], cold_outputs=[cold[0].outputs, cold[1].outputs], capture=captured,
        capture_s=capture_s, restore_s=restores.seconds, phases=restores.phases, weights_sources=restores.sources,
        restored_outputs=restores.outputs, standby=standbys, notes=notes,
        instances=[c.instance_id for c in cold] + restores.instances)
    return bench_record(spec, options, model_dir, measured, floor, facts, vllm_on)


def _cold_starts(own: ModelSpec, cache_env: dict[str, str], options: BenchOptions, timings: Timings,
                 outputs: Callable[[str], list[Completion]]) -> list[ColdStart]:
    """The fully cold start (an empty compile cache), then the warm-cache ones; the outputs of the
    first two (what the restored server's are compared with)."""
    with timings.phase("cold start (fully cold)"):
        cold = [cold_start(own, cache_env, outputs)]
    for n in range(options.cold_runs or max(1, options.runs - 1)):
        with timings.phase(f"cold start (warm cache) #{n + 1}"):
            cold.append(cold_start(own, cache_env, outputs if n == 0 else None))
    return cold


@dataclass(frozen=True)
class Restores:
    seconds: list[float]  # `vsnap restore --detach` to the first completion, each run
    phases: list[dict[str, float]]  # each run's (cli_phases)
    sources: set[Any]  # where each run's weights came from
    outputs: list[Completion]  # the first restored server's
    instances: list[str]


def _restores(image: str, spec: ModelSpec, options: BenchOptions, started: list[str], timings: Timings,
              outputs: Callable[[str], list[Completion]], notes: dict[str, list[str]]) -> Restores:
    """``runs`` times: `vsnap restore --detach` to the first completion (timed), then stop; the
    first restored server's outputs and engine notes besides."""
    seconds: list[float] = []
    phases: list[dict[str, float]] = []
    sources: set[Any] = set()
    instances: list[str] = []
    restored_outputs: list[Completion] = []
    for n in range(options.runs):
        with timings.phase(f"restore to first token #{n + 1}"):
            start = time.monotonic()
            doc = run_cli(["restore", image, "--port", "0", "--detach"]
                          + (["--lazy-pages"] if options.lazy_pages else []), started)
            first_token(doc["url"], spec.served_model_name)
            seconds.append(time.monotonic() - start)
        instances.append(doc["instance"])
        if n == 0:
            with timings.phase("outputs of the restored server"):
                restored_outputs = outputs(doc["url"])
            notes["restore"] = engine_notes(Path(doc["engine_log"]))
        phases.append(cli_phases(doc))
        sources.add(doc.get("weights_source"))
        started.remove(doc["instance"])
        stop_instance(doc["instance"])
    return Restores(seconds, phases, sources, restored_outputs, instances)


def measure_standby(image: str, spec: ModelSpec, runs: int, started: list[str], timings: Timings,
                    notes: dict[str, list[str]]) -> dict[str, Any]:
    """``runs`` times: `vsnap restore --standby --detach` (timed, and the standby's host memory),
    then `vsnap activate` to the first completion (timed), then stop."""
    restore_s: list[float] = []
    memory: list[int] = []
    activations: list[float] = []
    phases: list[dict[str, float]] = []
    ids: list[str] = []
    for n in range(runs):
        with timings.phase(f"standby #{n + 1}"):
            start = time.monotonic()
            waiting = run_cli(["restore", image, "--standby", "--detach"], started)
            restore_s.append(time.monotonic() - start)
            memory.append(int(waiting["memory_bytes"]))
        with timings.phase(f"activation to first token #{n + 1}"):
            start = time.monotonic()
            doc = run_cli(["activate", waiting["instance"], "--port", "0"], started)
            first_token(doc["url"], spec.served_model_name)
            activations.append(time.monotonic() - start)
        if n == 0:
            notes["activate"] = engine_notes(Path(doc["engine_log"]))
        phases.append(cli_phases(doc))
        ids.append(doc["instance"])
        started.remove(doc["instance"])
        stop_instance(doc["instance"])
    return standby_record(restore_s, memory, activations, phases, ids)

