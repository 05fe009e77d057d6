"""run_bench(): cold start vs restore to first token, in one run, with the breakdown and the floor.

* cold start to first token: the engine tree launched in "serve" mode (the same code, without the
  snapshot work), from launch to the first HTTP completion; "fully cold" with an empty compile
  cache, then "warm cache" reusing it (vLLM; the cpu engine has no compile cache);
* capture: `capture_image()` of the spec, with the warm cache, into an image of the bench's own;
* restore to first token: a `vsnap restore --detach` command (a new interpreter, as a user runs it)
  plus the first completion, ``runs`` times;
* standby (unless turned off): `vsnap restore --standby --detach` (its time and host memory), then
  `vsnap activate` plus the first completion, ``runs`` times;
* equal outputs: BENCH_PROMPTS prompts x BENCH_TOKENS greedy tokens, sent one at a time to the
  fully cold start, the first warm cold start and the first restore, token ids and logprobs
  compared (restored vs cold is the result; cold vs cold says how far the engine agrees with itself);
* floor: the image's CRIU bytes over this disk's measured read bandwidth (8 threads, page cache as
  it is), plus the weight bytes a restore reads besides CRIU's pages over the slower of that
  bandwidth and the measured host-to-device bandwidth (vLLM on CUDA: pinned copies in a CUDA
  subprocess; the cpu engine: the read bandwidth). On vLLM's CPU backend the weights come back
  inside CRIU's pages: no separate weight bytes, no host-to-device copy.

The spec's own image and control directory are never touched: the bench works in two private
directories beside them (``.<image name>.bench-XXXX`` next to the image: the bench image and the
compile cache; ``.<control name>.bench-XXXX`` next to the control directory: the trees' control
and instance directories) and removes both, every tree it started, every restored server and
every /dev/shm directory on every exit path. A failed bench first copies its engine and CRIU
logs to ``out_dir`` (the error then names the copy).
"""

from __future__ import annotations

import datetime as dt
import io
import json
import math
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from vsnap.host import verified
from vsnap.host.cleanup import Cleanup
from vsnap.host.events import ProgressCallback, Timings
from vsnap.host.facts import host_facts, require_host, vllm_device
from vsnap.host.instances import new_instance_dir, running_instances
from vsnap.host.proctree import launch_tree
from vsnap.host.shm import instance_shm_dir, remove_instance_shm
from vsnap.host.trust import copy_no_follow, make_trusted_dirs
from vsnap.image.manifest import ENGINE_LOG, WEIGHTS_DIR
from vsnap.image.store import check_parent
from vsnap.ops.capture import capture_image, end_launched_tree, launch_config, resolve_model, tree_environment
from vsnap.ops.restore import _wait_status, handed_over_listener, stop_server
from vsnap.protocol import control
from vsnap.protocol.errors import EngineError, UnsupportedOption, VsnapError
from vsnap.spec.schema import ModelSpec

BENCH_PROMPTS = 32
BENCH_TOKENS = 16
REQUEST_TIMEOUT_S = 300
CLI_TIMEOUT_S = 900  # one `vsnap restore` / `vsnap activate` the bench runs
NOTE_PREFIX = "vsnap:"  # the engine's own log lines worth keeping in the record

Completion = tuple[list[int], list[float]]  # token ids, the logprob of each


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
            return dict(json.load(response))
    except (OSError, ValueError) as exc:  # URLError and HTTPError are OSErrors
        raise EngineError("bench", "RequestFailed", f"POST {url}/v1/completions failed: {exc}") from None


def first_token(url: str, model: str) -> None:
    _post(url, {"model": model, "prompt": "Hello", "max_tokens": 1, "temperature": 0})["choices"][0]


def bench_prompts(n: int = BENCH_PROMPTS) -> list[str]:
    """``n`` different short prompts, the same in every run."""
    subjects = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 5, 8,", "Once upon a time",
                "The weather today", "import numpy as np", "Dear Sir or Madam,", "SELECT * FROM"]
    return [f"{subjects[i % len(subjects)]} ({i})" for i in range(n)]


def parse_completion(choice: dict[str, Any]) -> Completion:
    """Token ids and their logprobs from one completion choice: the ids from ``token_ids`` (the
    cpu engine, vLLM with return_token_ids) or from vLLM's ``token_id:N`` logprob tokens
    (return_tokens_as_token_ids), the logprobs from ``logprobs.token_logprobs``."""
    logprobs = choice.get("logprobs") or {}
    ids = choice.get("token_ids")
    if not isinstance(ids, list):
        tokens = logprobs.get("tokens") or []
        try:
            ids = [int(str(t).removeprefix("token_id:")) for t in tokens]
        except ValueError:
            raise EngineError("bench", "NoTokenIds", f"the completion has no token ids (tokens {tokens[:3]}...)") from None
    values = [float("nan") if v is None else float(v) for v in logprobs.get("token_logprobs") or []]
    return [int(t) for t in ids], values


def lora_adapter_names(serve: dict[str, Any]) -> list[str]:
    """The names of the LoRA adapters a vLLM spec loads at boot (``lora_modules``: ``name=path``
    strings or ``{"name": ..., "path": ...}`` mappings, as vLLM's parser takes them)."""
    modules = serve.get("lora_modules", serve.get("lora-modules")) or []
    names = []
    for module in modules if isinstance(modules, list) else [modules]:
        if isinstance(module, dict):
            names.append(str(module.get("name", "")))
        elif isinstance(module, str):
            text = module.strip()
            names.append(str(json.loads(text).get("name", "")) if text.startswith("{") else text.split("=", 1)[0])
    return [name for name in names if name]


def served_models(spec: ModelSpec) -> list[str]:
    """The names the bench asks: the served model, then each LoRA adapter given at boot."""
    return [spec.served_model_name, *lora_adapter_names(spec.serve)]


def completions(url: str, model: str, prompts: list[str], max_tokens: int = BENCH_TOKENS) -> list[Completion]:
    """Greedy completions of each prompt, one request at a time (the same batches on every server)."""
    out = []
    for prompt in prompts:
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": 1,
                "ignore_eos": True, "return_tokens_as_token_ids": True}
        out.append(parse_completion(_post(url, body)["choices"][0]))
    return out


def compare_outputs(expected: list[Completion], actual: list[Completion]) -> dict[str, Any]:
    """Per prompt, the first position where the token ids differ (a shorter output differs where
    it ends); the largest |logprob difference| over the positions before that (after it the two
    continue from different tokens). A NaN logprob on either side counts as a differing token."""
    if len(expected) != len(actual):
        raise ValueError(f"{len(expected)} completions to compare with {len(actual)}")
    mismatches, worst, tokens = [], 0.0, 0
    for index, ((ids_a, lps_a), (ids_b, lps_b)) in enumerate(zip(expected, actual)):
        tokens += len(ids_a)
        first = next((p for p, (a, b) in enumerate(zip(ids_a, ids_b)) if a != b), None)
        if first is None and len(ids_a) != len(ids_b):
            first = min(len(ids_a), len(ids_b))
        end = len(ids_a) if first is None else first
        for position in range(min(end, len(lps_a), len(lps_b))):
            a, b = lps_a[position], lps_b[position]
            if math.isnan(a) or math.isnan(b):
                first = position if first is None else min(first, position)
                break
            worst = max(worst, abs(a - b))
        if first is not None:
            mismatches.append({"prompt": index, "position": first})
    return {"prompts": len(expected), "tokens": tokens, "mismatched_prompts": len(mismatches),
            "first_mismatch_position": min((m["position"] for m in mismatches), default=None),
            "max_logprob_diff": worst, "mismatches": mismatches}


def engine_notes(log: Path, limit: int = 40) -> list[str]:
    """The engine's own ``vsnap:`` lines from one of its logs (what the record keeps of it)."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return []
    return [line[:400] for line in lines if line.startswith(NOTE_PREFIX)][-limit:]


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
    control_dir = control.ensure_private_dir(spec.control_dir)
    instance_id, work = new_instance_dir(control_dir, "cold")
    log = work / control.ENGINE_LOG
    with Cleanup() as cleanup:
        cleanup.on_success(shutil.rmtree, work, True)  # a failed one keeps it: the logs its error names
        launch = launch_config(spec, resolve_model(spec)).model_copy(update={"mode": "serve"})
        control.write_message(work, control.LAUNCH, launch)
        shm = instance_shm_dir(instance_id)
        cleanup.on_exit(remove_instance_shm, shm)
        env = {**tree_environment(control_dir, work, spec.engine), **env_extra}
        heartbeat = control.OwnerHeartbeat(work).start()
        cleanup.on_exit(heartbeat.stop)
        start = time.monotonic()
        tree = launch_tree(control_dir, work, shm, env, adopt=lambda launched: cleanup.on_exit(end_launched_tree, launched))
        _wait_status(work, tree.identity, ("validated",), "boot engine", log)
        with handed_over_listener(work, tree.identity, "127.0.0.1", 0, log) as port:
            url = f"http://127.0.0.1:{port}"
            first_token(url, spec.served_model_name)
            seconds = time.monotonic() - start
            return ColdStart(seconds, while_up(url) if while_up is not None else [], instance_id)


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
    # from / : `python -c` puts its working directory first on sys.path
    out = subprocess.run([sys.executable, "-c", H2D_PROBE], capture_output=True, text=True, timeout=300, cwd="/")
    try:
        return float(out.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return None


@dataclass(frozen=True)
class Floor:
    seconds: float
    weight_bytes: int  # what a restore reads besides CRIU's pages
    read_bytes_per_s: float
    h2d_bytes_per_s: float | None  # measured only where the weights go to a GPU


def restore_floor(image_files: list[Path], image_bytes: int, model_dir: Path, vllm_on: str | None, *,
                  read: Callable[[list[Path]], float] = read_bandwidth,
                  h2d: Callable[[], float | None] = h2d_bandwidth) -> Floor:
    """The least a restore can take: bytes moved over measured bandwidths. ``vllm_on`` is
    ``vllm_device()`` for the vllm engine ("cuda" or "cpu"), None for the cpu engine.

    The weights a restore reads besides CRIU's pages: the image's weights file, else the model's
    safetensors (vLLM's loader on CUDA, the cpu engine's reload); none on vLLM's CPU backend,
    where they come back as the tree's own memory. They move at the slower of the read and the
    host-to-device bandwidth (measured only on CUDA)."""
    weights_file = [p for p in image_files if p.parent.name == WEIGHTS_DIR]
    if weights_file:
        weights = weights_file
    elif vllm_on == "cpu":
        weights = []
    else:
        weights = sorted(model_dir.rglob("*.safetensors"))
    weight_bytes = sum(p.stat().st_size for p in weights)
    disk_bw = read(image_files)
    h2d_bw = h2d() if vllm_on == "cuda" else None
    rest_bytes = image_bytes - (weight_bytes if weights_file else 0)  # what CRIU reads
    seconds = rest_bytes / disk_bw + weight_bytes / min(disk_bw, h2d_bw or disk_bw)
    return Floor(seconds, weight_bytes, disk_bw, h2d_bw)


def _median_phases(runs: list[dict[str, float]]) -> dict[str, float]:
    keys = [k for k in runs[0] if all(k in r for r in runs)]
    return {k: statistics.median(r[k] for r in runs) for k in keys}


def run_bench(spec: ModelSpec, *, runs: int = 3, cold_runs: int | None = None, lazy_pages: bool = False,
              standby: bool = True, out_dir: Path | None = None,
              on_event: ProgressCallback | None = None) -> dict[str, Any]:
    timings = Timings(on_event)
    if spec.engine == "vllm":
        from vsnap.engine.adapters.vllm.serve_args import serves_tls

        if serves_tls(dict(spec.serve)):
            raise UnsupportedOption("serve.ssl_*", "vsnap bench speaks plain HTTP to the servers it measures",
                                    hint="bench a copy of the spec without serve.ssl_keyfile and serve.ssl_certfile")
    with timings.phase("preflight"):
        if out_dir is not None:
            make_trusted_dirs(out_dir)  # before minutes of measuring: the record must be writable safely
        require_host(spec.engine)
        model_dir = resolve_model(spec)
    stem = f"bench-{spec.name}-{dt.date.today().isoformat()}" + ("-lazy-pages" if lazy_pages else "")
    prompts = bench_prompts()

    models = served_models(spec)

    def outputs(url: str) -> list[Completion]:  # every prompt through the model, then through each LoRA adapter
        return [c for model in models for c in completions(url, model, prompts)]

    with Cleanup() as cleanup:
        dirs = make_bench_dirs(spec, cleanup)
        own = bench_spec(spec, dirs)
        cleanup.on_exit(verified.forget, dirs.image)  # capture and restores remember what they hashed
        started: list[str] = []  # instances the bench's `vsnap restore` commands started

        def stop_all() -> None:
            while started:
                stop_instance(started.pop())

        cleanup.on_exit(stop_all)
        try:
            record = _measure(spec, own, dirs, model_dir, runs, cold_runs, lazy_pages, standby, timings, outputs,
                              started)
        except BaseException as error:
            keep_evidence(error, dirs, out_dir, stem)
            raise
    record["work"] = {**record["work"], "image_work": str(dirs.image_work), "control_work": str(dirs.control_work),
                      "removed": not dirs.image_work.exists() and not dirs.control_work.exists()}
    if out_dir is not None:
        write_record(record, out_dir, stem)
    return record


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


def _phases(doc: dict[str, Any]) -> dict[str, float]:
    """A `vsnap restore/activate --json` document's phases and the engine's own breakdown."""
    return {**doc.get("timings", {}), **{k if k.startswith("verify_") else f"engine {k}": v
                                         for k, v in (doc.get("recovery") or {}).items() if k.endswith("_s")},
            "cli_overhead_s": doc["cli_overhead_s"], "cli_start_s": float(doc.get("command_start_s") or 0.0)}


def _measure(spec: ModelSpec, own: ModelSpec, dirs: BenchDirs, model_dir: Path, runs: int, cold_runs: int | None,
             lazy_pages: bool, standby: bool, timings: Timings, outputs: Callable[[str], list[Completion]],
             started: list[str]) -> dict[str, Any]:
    cache_env = {"VLLM_CACHE_ROOT": str(dirs.cache)} if spec.engine == "vllm" else {}
    with timings.phase("cold start (fully cold)"):
        cold = [cold_start(own, cache_env, outputs)]
    for n in range(cold_runs or max(1, runs - 1)):
        with timings.phase(f"cold start (warm cache) #{n + 1}"):
            cold.append(cold_start(own, cache_env, outputs if n == 0 else None))
    fully_cold, warm = cold[0].seconds, [c.seconds for c in cold[1:]]
    start = time.monotonic()
    with timings.phase("capture"):
        captured = capture_image(own, env=cache_env)  # with the warm cache too
    capture_s = time.monotonic() - start
    notes = {"capture": engine_notes(captured.image_dir / ENGINE_LOG)}
    image = str(captured.image_dir)
    restores, phases, sources, instances = [], [], set(), [c.instance_id for c in cold]
    restored_outputs: list[Completion] = []
    for n in range(runs):
        with timings.phase(f"restore to first token #{n + 1}"):
            start = time.monotonic()
            doc = run_cli(["restore", image, "--port", "0", "--detach"] + (["--lazy-pages"] if lazy_pages else []),
                          started)
            first_token(doc["url"], spec.served_model_name)
            restores.append(time.monotonic() - start)
        instances.append(doc["instance"])
        if n == 0:
            with timings.phase("outputs of the restored server"):
                restored_outputs = outputs(doc["url"])
            notes["restore"] = engine_notes(Path(doc["engine_log"]))
        phases.append(_phases(doc))
        sources.add(doc.get("weights_source"))
        started.remove(doc["instance"])
        stop_instance(doc["instance"])
    standbys = _measure_standby(image, spec, runs, started, timings, notes) if standby else None
    image_files = [captured.image_dir / rel for rel in captured.manifest.files]
    vllm_on = vllm_device() if spec.engine == "vllm" else None
    floor = restore_floor(image_files, captured.image_bytes, model_dir, vllm_on)
    facts = host_facts(spec.engine)
    cold_median = statistics.median(warm)
    restore_median = statistics.median(restores)
    return {
        "date": dt.date.today().isoformat(),
        "command": f"vsnap bench SPEC --runs {runs}" + (f" --cold-runs {cold_runs}" if cold_runs else "")
                   + (" --lazy-pages" if lazy_pages else "") + ("" if standby else " --no-standby"),
        "timed": "from starting the `vsnap restore` (or `vsnap activate`) command to the first completion answered",
        "lazy_pages": lazy_pages,
        "model": f"{spec.name} ({model_dir})",
        "gpu": facts.gpus[0]["name"] if facts.gpus else None,
        "device": "cuda" if vllm_on == "cuda" else "cpu",  # vllm on "cpu": vLLM's CPU backend
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
        "weight_bytes": floor.weight_bytes,
        "weights_source": sorted(str(x) for x in sources),
        "processes": captured.manifest.processes,
        "phases": _median_phases(phases),
        "phases_per_restore": phases,  # the spread of the median, phase by phase
        "floor_s": floor.seconds,
        "floor_inputs": {"image_read_bytes_per_s": floor.read_bytes_per_s, "h2d_bytes_per_s": floor.h2d_bytes_per_s},
        "outputs": {"max_tokens": BENCH_TOKENS, "greedy": True,
                    "models": served_models(spec),
                    "restored_vs_cold": {"expected": "warm cold start #1", "actual": "restore #1",
                                         **compare_outputs(cold[1].outputs, restored_outputs)},
                    "cold_vs_cold": {"expected": "fully cold start", "actual": "warm cold start #1",
                                     **compare_outputs(cold[0].outputs, cold[1].outputs)}},
        "standby": standbys,
        "engine_notes": notes,
        "work": {"instances": instances + [i for i in (standbys or {}).get("instances", [])]},
    }


def _measure_standby(image: str, spec: ModelSpec, runs: int, started: list[str], timings: Timings,
                     notes: dict[str, list[str]]) -> dict[str, Any]:
    """``runs`` times: `vsnap restore --standby --detach` (timed, and the standby's host memory),
    then `vsnap activate` to the first completion (timed), then stop."""
    restore_s, memory, activations, phases, ids = [], [], [], [], []
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
        phases.append(_phases(doc))
        ids.append(doc["instance"])
        started.remove(doc["instance"])
        stop_instance(doc["instance"])
    return {"standby_restore_s": restore_s, "standby_restore_s_median": statistics.median(restore_s),
            "standby_host_memory_bytes": memory, "activation_to_first_token_s": activations,
            "activation_to_first_token_s_median": statistics.median(activations),
            "activation_spread_s": [min(activations), max(activations)], "phases": _median_phases(phases),
            "instances": ids}


def write_record(record: dict[str, Any], out_dir: Path, stem: str) -> Path:
    """JSON, a markdown table and (when matplotlib is there) a plot, written atomically into a
    directory that is root's alone (a link planted at a record's name is replaced, never followed)."""
    make_trusted_dirs(out_dir)
    control.write_atomic(out_dir, f"{stem}.json", (json.dumps(record, indent=2) + "\n").encode())
    floor_label = ("image read + weights to device" if record["floor_inputs"].get("h2d_bytes_per_s")
                   else "image and weights read" if record["weight_bytes"] else "image read")
    weights_read = (f"{record['weight_bytes'] / 1e9:.2f} GB read besides CRIU's pages" if record["weight_bytes"]
                    else "inside CRIU's pages")
    lines = [f"# {record['model']} on {record['gpu'] or 'CPU'} ({record['date']})", "",
             f"`{record['command']}`", "", "| | seconds |", "|---|---|",
             f"| cold start to first token, fully cold | {record['cold_start_fully_cold_s']:.2f} |",
             f"| cold start to first token, warm compile cache (median) | {record['cold_start_to_first_token_s_median']:.2f} |",
             f"| **restore to first token (median of {record['runs']})** | **{record['restore_to_first_token_s_median']:.2f}** "
             f"({record['restore_spread_s'][0]:.2f} to {record['restore_spread_s'][1]:.2f}) |",
             f"| speedup over the warm cold start | {record['speedup_vs_warm_cold_start']:.1f}x |",
             f"| capture | {record['capture_s']:.2f} |",
             f"| floor ({floor_label}) | {record['floor_s']:.2f} |", "",
             f"Image {record['image_bytes'] / 1e9:.2f} GB, weights {weights_read} "
             f"(restored from: {', '.join(record.get('weights_source') or ['?'])}).", "",
             "Restore phases (medians):", "", "| phase | seconds |", "|---|---|"]
    lines += [f"| {k} | {v:.3f} |" for k, v in record["phases"].items()]
    if record.get("standby"):
        sb = record["standby"]
        lines += ["", "Standby (`vsnap restore --standby`, then `vsnap activate`):", "", "| | |", "|---|---|",
                  f"| **activation to first token (median of {len(sb['activation_to_first_token_s'])})** | "
                  f"**{sb['activation_to_first_token_s_median']:.2f} s** ({sb['activation_spread_s'][0]:.2f} to "
                  f"{sb['activation_spread_s'][1]:.2f}) |",
                  f"| standby restore (median) | {sb['standby_restore_s_median']:.2f} s |",
                  f"| host memory of a standby | {max(sb['standby_host_memory_bytes']) / 1e9:.2f} GB (no GPU memory) |"]
        lines += [f"| activation: {k} | {v:.3f} s |" for k, v in sb["phases"].items()]
    if record.get("processes"):
        lines += ["", "What fills the image (each process of the tree at the dump):", "",
                  "| process | anonymous memory | GPU memory before the CUDA checkpoint |", "|---|---|---|"]
        lines += [f"| `{proc['command'][:50]}` | {proc['anonymous_bytes'] / 1e6:.0f} MB | "
                  f"{proc['gpu_bytes'] / 1e6:.0f} MB |" if "gpu_bytes" in proc else
                  f"| `{proc['command'][:50]}` | {proc['anonymous_bytes'] / 1e6:.0f} MB | - |"
                  for proc in record["processes"]]
    if record.get("outputs"):
        models = record["outputs"].get("models") or []
        through = f", through each of {', '.join(models)}" if len(models) > 1 else ""
        lines += ["", f"Equal outputs ({BENCH_PROMPTS} prompts x {record['outputs']['max_tokens']} greedy tokens{through}, "
                      "token ids compared; logprobs before the first differing token):", "",
                  "| servers | prompts that differ | first differing position | largest logprob difference |",
                  "|---|---|---|---|"]
        for key in ("restored_vs_cold", "cold_vs_cold"):
            c = record["outputs"].get(key)
            if c:
                position = "-" if c["first_mismatch_position"] is None else c["first_mismatch_position"]
                lines.append(f"| {c['actual']} vs {c['expected']} | {c['mismatched_prompts']} of {c['prompts']} | "
                             f"{position} | {c['max_logprob_diff']:.3g} |")
    png = plot(record)
    if png is not None:
        control.write_atomic(out_dir, f"{stem}.png", png)
        lines += ["", f"![restore vs cold start]({stem}.png)"]
    control.write_atomic(out_dir, f"{stem}.md", ("\n".join(lines) + "\n").encode())
    return out_dir / f"{stem}.md"


def plot(record: dict[str, Any]) -> bytes | None:
    """The record as a PNG (None without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
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
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    plt.close(fig)
    return buffer.getvalue()
