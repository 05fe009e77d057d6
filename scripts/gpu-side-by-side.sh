#!/usr/bin/env bash
# gpu-side-by-side.sh - issue 25 step 4: vLLM 0.33's own `vllm snapshot create` / `restore`, run as
# vLLM's docs say, against `vsnap capture` / `restore`, side by side in one device call on one H200:
# the same 8B model (scripts/make_test_model.py --shape 8b: the Llama-3-8B shape, random bf16
# weights, 16 GB) and the same vLLM arguments (--max-model-len 2048 --gpu-memory-utilization 0.45;
# both add --enable-sleep-mode, so the cold server gets it too).
#
# Before it, on the same warm machine: vLLM 0.33 in /tmp/site033 (scripts/gpu-install-vllm033.sh,
# one call per .carry/vllm033-parts-NN, back to back). Then one call:
#   carry: [".carry/criu", ".carry/cuda-checkpoint"]    timeout_s: 600
#   command: bash scripts/gpu-side-by-side.sh
# .carry/cuda-checkpoint/cuda-checkpoint is NVIDIA's utility (github.com/NVIDIA/cuda-checkpoint,
# bin/x86_64_Linux at commit 6ec728aff032, 5976 bytes, sha256 707fa7f5...): `vllm snapshot` needs it
# (CRIU's CUDA plugin runs it); vsnap does not (it calls the driver's checkpoint API itself). It is on
# PATH only for the `vllm` commands: on PATH, CRIU's CUDA plugin (in the carried bundle, which CRIU
# loads for every dump) would act inside vsnap's dumps too. Used for this comparison only.
#
# vllm snapshot wants "an immutable remote model and 40-character --revision" (it refuses a local
# directory) and the GPU machine reaches no hub: the model is written straight into a Hugging Face
# cache layout (HF_HOME=$WORK/hf, hub/models--vsnap-test--llama-8b/snapshots/REV/, regular files),
# and every vLLM command runs with HF_HUB_OFFLINE=1, which resolves vsnap-test/llama-8b at REV to
# that directory; vsnap's spec names the same directory and the same served name. One compile cache
# for the three boots (VLLM_CACHE_ROOT=/var/cache/vsnap/vllm, vsnap's default): the cold start
# compiles, both captures boot with a warm cache.
#
# Steps, with their expected seconds on the H200 (session 12's vLLM 0.33 numbers: cold start 122 s
# fully cold, boot 84 s with a warm cache, vsnap capture 113 s, restore 2.3 s; ~510 s in all):
#   0. environment (scripts/gpu-env.sh), host facts, /etc/machine-id (vllm snapshot needs one)   ~25
#   1. the model into the HF cache layout (in the background, beside step 0)                    ~35
#   2. cold `vllm serve` (fully cold compile cache) to its first completion; 32 prompts x 16
#      greedy tokens, the reference (vsnap.ops.bench.outputs); stop (COLD_LOAD=1: a load too)    ~130
#   3. `vllm snapshot create` (timed), `vllm snapshot inspect`, du of the artifact               ~100
#   4. `vllm snapshot restore`, timed from the command's start to the first completion over
#      HTTP; outputs against the cold ones; a load; GPU memory; what it refuses: a second
#      restore at once, the same GPU under another CUDA_VISIBLE_DEVICES; stop                     ~45
#   5. `vsnap capture` (timed; warm compile cache; the weights file in the image)                ~115
#   6. `vsnap restore --detach`, timed the same way; outputs; a load; GPU memory; a second
#      instance at once (--gpu UUID, another port); stop; a changed model file (2048 bf16
#      values of lm_head.weight reversed in place, same size, put back after)                    ~30
#   7. `vllm snapshot restore` with that changed model file; its outputs if it serves; stop      ~30
#   8. the record: $OUT/side-by-side/{side-by-side.json,side-by-side.md,logs.tgz,run.log}, the
#      table printed last (also after a failure: the EXIT trap writes it)                         ~5
# Every wait has a timeout. A step that would pass BUDGET_S is skipped and named in the record;
# the optional ones (loads, refusals, the changed model) give way to the restores and captures
# still ahead. Run again on the same warm machine and what is already made (model, cold
# reference, vllm artifact, vsnap image) is kept; STEPS="4 7" runs only those steps (0, 1 always).
# Env: OUT, PY, SITE033 (/tmp/site033), WORK (/tmp/vsnap-sbs), BUDGET_S (555: the call's 600 s, less a
# margin for the cleanup), STEPS (all), LOAD_S (6), LOAD_CONC (16), LOAD_TOKENS (64), COLD_LOAD (0),
# GPU_UTIL (0.45), FRESH=1 (start from nothing), ENV_SCRIPT (scripts/gpu-env.sh), CKPT_DIR
# (.carry/cuda-checkpoint), CRIU_BUNDLE (/opt/criu-bundle).
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO" || exit 10
START=$(date +%s.%N)
OUT=${OUT:-/tmp/vsnap-gpu-out}
RESULTS=$OUT/side-by-side
PY=${PY:-/opt/torch/.venv/bin/python3}
[ -x "$PY" ] || PY=python3
# The whole run under a child subreaper that reaps at once. `vllm snapshot create` checks that every
# PID it dumped is gone with kill(pid, 0), which a zombie passes: CRIU kills the tree, its root is
# reaped by vllm, and the root's children (EngineCore, ...) go to the nearest subreaper, or to PID 1,
# which on the GPU machine did not reap them in time (session 14: "process survived CRIU dump").
# On a host whose init reaps, nothing changes; here those orphans come to this reaper instead.
if [ "${SBS_REAPED:-0}" != 1 ]; then
  exec env SBS_REAPED=1 "$PY" -c '
import ctypes, os, sys
if ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) != 0:  # PR_SET_CHILD_SUBREAPER
    sys.exit("gpu-side-by-side.sh: prctl(PR_SET_CHILD_SUBREAPER) failed")
child = os.fork()
if child == 0:
    os.execvp(sys.argv[1], sys.argv[1:])
while True:
    try:
        pid, status = os.waitpid(-1, 0)
    except ChildProcessError:
        sys.exit(1)
    if pid == child:
        code = os.waitstatus_to_exitcode(status)
        sys.exit(code if code >= 0 else 128 - code)
' bash "$0" "$@"
fi
export VLLM_SITE=${SITE033:-/tmp/site033}
WORK=${WORK:-/tmp/vsnap-sbs}
BUDGET_S=${BUDGET_S:-555}
RESERVE_S=30                       # kept for the cleanup and the record
LOAD_S=${LOAD_S:-6}
LOAD_CONC=${LOAD_CONC:-16}
LOAD_TOKENS=${LOAD_TOKENS:-64}
GPU_UTIL=${GPU_UTIL:-0.45}         # two vsnap instances fit on one GPU: the second-restore test
MAX_LEN=2048
PORT_COLD=8020 PORT_VLLM=8021 PORT_VLLM2=8022 PORT_VSNAP=8031 PORT_VSNAP2=8032
CKPT_DIR=${CKPT_DIR:-$REPO/.carry/cuda-checkpoint}
CRIU_BUNDLE=${CRIU_BUNDLE:-/opt/criu-bundle}   # where scripts/gpu-env.sh unpacks .carry/criu
REPO_ID=vsnap-test/llama-8b
REV=$( { echo "shape 8b seed 0"; cat scripts/make_test_model.py; } | sha1sum | cut -c1-40)  # 40 hex, as vllm wants
MODEL_DIR=$WORK/hf/hub/models--${REPO_ID/\//--}/snapshots/$REV
SNAP=$WORK/vllm-snapshots/llama-8b
IMAGE=$WORK/images/sbs-8b
SPEC=$WORK/sbs-8b.yaml
VLLM_ARGS=(--revision "$REV" --tokenizer-revision "$REV" --max-model-len "$MAX_LEN" --gpu-memory-utilization "$GPU_UTIL")
VSNAP=("$PY" -m vsnap)
VLLM_CLI=("$PY" -m vllm.entrypoints.cli.main)
COLD_SID="" VLLM_ROOT="" VLLM_PIDS="" VSNAP_LIVE=0 ENV_OK=0 MODEL_PID=""
AHEAD=0                            # seconds the essential steps still ahead need (optional steps leave them)

[ "${FRESH:-0}" = 1 ] && rm -rf "$WORK"
mkdir -p "$RESULTS" "$WORK/res" "$WORK/logs" && chmod 700 "$WORK"
RES=$WORK/res LOGS=$WORK/logs
echo "#run $START" >> "$RES/kv.tsv"   # an earlier run's results stay (resume); its errors and skips do not
exec > >(tee -a "$RESULTS/run.log") 2>&1
now() { date +%s.%N; }
secs() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2f", b - a }'; }
log() { echo "[$(date +%H:%M:%S) +$(secs "$START" "$(now)")s] $*"; }
left() { awk -v s="$START" -v b="$BUDGET_S" -v n="$(now)" 'BEGIN { printf "%d", b - (n - s) }'; }
put() { printf '%s\t%s\n' "$1" "$2" >> "$RES/kv.tsv"; }                        # KEY JSON-or-text
putf() { [ -s "$2" ] && printf '%s\t@%s\n' "$1" "$2" >> "$RES/kv.tsv"; }      # KEY file holding JSON
jstr() { "$PY" -c 'import json,sys; print(json.dumps(sys.argv[1]))' "$1"; }
fail() { local m=$2; [ ${#m} -gt 600 ] && m=${m: -600}; log "FAIL $1: $m"; put "errors.$1" "$(jstr "$m")"; }
# fits NEED NAME: time for a step of NEED seconds, the essential steps ahead and the reserve? Else it is skipped.
fits() {
  [ "$(left)" -gt $(($1 + AHEAD + RESERVE_S)) ] && return 0
  log "skip $2: ~$1 s needed (+$AHEAD s kept for what follows), $(left) s left of BUDGET_S=$BUDGET_S"
  put "skipped.$2" "$(jstr "budget: $(left) s left, ~$1 s needed, $AHEAD s kept for the essential steps after it")"
  return 1
}
want() { [ "${STEPS:-all}" = all ] || [[ " $STEPS " == *" $1 "* ]]; }   # STEPS="4 6 7": only those
cap() { local l=$(($(left) - RESERVE_S)); [ "$l" -lt "$1" ] && echo $((l > 5 ? l : 5)) || echo "$1"; }  # a step's timeout

HELPER=$WORK/sbs.py
cat > "$HELPER" <<'PYHELPER'
"""The Python side of scripts/gpu-side-by-side.sh (written out by it each run): HTTP probes, the
outputs and their comparison (vsnap.ops.bench.outputs), a bounded load, the in-place model change,
the record. Loopback only; every request and wait has a timeout."""
import hashlib, json, os, socket, statistics, sys, threading, time, urllib.request


def post(url, body, timeout):
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as response:
        return json.load(response)


def alive(pid):
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def first(url, model, t0, timeout, pid=0):
    """From t0 (the command's start, epoch s): when the port first accepted a TCP connection and when
    the first 1-token completion came back. Exit 0, 1 (timeout), 2 (the process PID exited)."""
    host, port = url.split("//")[1].rsplit(":", 1)
    t0, deadline, pid = float(t0), float(t0) + float(timeout), int(pid)
    doc = {"url": url, "port_open_s": None, "first_completion_s": None}
    rc = 1
    while time.time() < deadline:
        if pid and not alive(pid):
            doc["error"], rc = f"process {pid} exited", 2
            break
        if doc["port_open_s"] is None:
            try:
                socket.create_connection((host, int(port)), timeout=0.5).close()
                doc["port_open_s"] = round(time.time() - t0, 3)
            except OSError:
                time.sleep(0.02)
                continue
        try:
            body = post(url, {"model": model, "prompt": "Hello", "max_tokens": 1, "temperature": 0},
                        timeout=max(1.0, min(60.0, deadline - time.time())))
            if body.get("choices"):
                doc["first_completion_s"], rc = round(time.time() - t0, 3), 0
                break
        except (OSError, ValueError, KeyError) as exc:
            doc["last_error"] = f"{type(exc).__name__}: {exc}"[:300]
            time.sleep(0.05)
    print(json.dumps(doc))
    return rc


def port_open(url, t0, timeout):
    """Run beside a restore command: from t0, when the port first accepted a TCP connection (no
    request is sent: a completion there could batch with the restore's own check)."""
    host, port = url.split("//")[1].rsplit(":", 1)
    t0 = float(t0)
    while time.time() < t0 + float(timeout):
        try:
            socket.create_connection((host, int(port)), timeout=0.5).close()
            print(json.dumps({"port_open_s": round(time.time() - t0, 3)}))
            return 0
        except OSError:
            time.sleep(0.01)
    return 1


def outputs(url, model, out):
    """32 prompts x 16 greedy tokens, one request at a time: vsnap bench's own prompts and requests."""
    from vsnap.ops.bench.outputs import BENCH_TOKENS, bench_prompts, completions
    got = completions(url, model, bench_prompts(), BENCH_TOKENS)
    with open(out, "w") as f:
        json.dump([[ids, lps] for ids, lps in got], f)
    return 0


def compare(ref, actual, out):
    from vsnap.ops.bench.outputs import compare_outputs
    with open(ref) as a, open(actual) as b:
        result = compare_outputs(json.load(a), json.load(b))
    result["mismatches"] = result["mismatches"][:8]
    with open(out, "w") as f:
        json.dump(result, f)
    first_at = f" (first at token {result['first_mismatch_position']})" if result["mismatched_prompts"] else ""
    print(f"{result['mismatched_prompts']} of {result['prompts']} prompts differ{first_at}, "
          f"largest logprob difference {result['max_logprob_diff']:.3g}")
    return 0


def load(url, model, seconds, conc, max_tokens, out):
    """CONC threads of greedy completions (the bench prompts in turn, MAX_TOKENS each, ignore_eos) for
    SECONDS: completed requests, generated tokens per second, latency percentiles, errors."""
    from vsnap.ops.bench.outputs import bench_prompts
    if url.split("//")[1].rsplit(":", 1)[0] not in ("127.0.0.1", "localhost"):
        raise SystemExit("loopback only")
    prompts, seconds, conc, max_tokens = bench_prompts(), float(seconds), int(conc), int(max_tokens)
    lock, lat, state = threading.Lock(), [], {"requests": 0, "tokens": 0, "errors": 0, "samples": [], "n": 0}
    deadline = time.monotonic() + seconds

    def worker():
        while time.monotonic() < deadline:
            with lock:
                i = state["n"]
                state["n"] += 1
            start = time.monotonic()
            try:
                body = post(url, {"model": model, "prompt": prompts[i % len(prompts)], "max_tokens": max_tokens,
                                  "temperature": 0, "ignore_eos": True}, timeout=120)
                tokens = int(body["usage"]["completion_tokens"])
                err = None
            except (OSError, ValueError, KeyError, TypeError) as exc:
                tokens, err = 0, f"{type(exc).__name__}: {exc}"[:200]
            with lock:
                if err is None:
                    state["requests"] += 1
                    state["tokens"] += tokens
                    lat.append(time.monotonic() - start)
                else:
                    state["errors"] += 1
                    if len(state["samples"]) < 3:
                        state["samples"].append(err)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(conc)]
    t = time.monotonic()
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=seconds + 130)
    wall = time.monotonic() - t
    lat.sort()
    pct = lambda q: round(lat[min(len(lat) - 1, int(q * len(lat)))], 3) if lat else None
    doc = {"concurrency": conc, "max_tokens": max_tokens, "seconds": round(wall, 2), "requests": state["requests"],
           "errors": state["errors"], "error_samples": state["samples"], "tokens": state["tokens"],
           "tokens_per_s": round(state["tokens"] / wall, 1) if wall else None,
           "requests_per_s": round(state["requests"] / wall, 2) if wall else None,
           "latency_p50_s": pct(0.5), "latency_p90_s": pct(0.9),
           "latency_mean_s": round(statistics.fmean(lat), 3) if lat else None}
    with open(out, "w") as f:
        json.dump(doc, f)
    print(json.dumps(doc))
    return 0 if state["requests"] else 1


def _lm_head(model_dir):
    """(shard path, absolute offset, bytes, row bytes) of lm_head.weight in the model's safetensors."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    name = "lm_head.weight"
    shard = json.load(open(index))["weight_map"][name] if os.path.exists(index) else "model.safetensors"
    path = os.path.join(model_dir, shard)
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    entry = header[name]
    if entry["dtype"] != "BF16":
        raise SystemExit(f"{name} is {entry['dtype']}, not BF16")
    begin, end = entry["data_offsets"]
    return path, 8 + n + begin, end - begin, entry["shape"][1] * 2


def modify(model_dir, state_file, revert=""):
    """Reverse the order of 2048 bf16 values (4 KiB) in the middle row of lm_head.weight, in place:
    the file keeps its size and its values' statistics; the model is another (that row's token
    scores change). The operation is its own inverse: --revert applies it again and checks the bytes."""
    import numpy as np
    if revert:
        if not os.path.exists(state_file):
            return 0
        state = json.load(open(state_file))
        path, offset, length = state["file"], state["offset"], state["length"]
    else:
        path, start, size, row = _lm_head(model_dir)
        rows = size // row
        offset, length = start + (rows // 2) * row, min(4096, row)
    with open(path, "r+b") as f:
        f.seek(offset)
        before = f.read(length)
        after = np.frombuffer(before, dtype=np.uint16)[::-1].tobytes()
        f.seek(offset)
        f.write(after)
        f.flush()
        os.fsync(f.fileno())
    digest = lambda b: hashlib.sha256(b).hexdigest()
    if revert:
        if digest(after) != state["sha256_before"]:
            raise SystemExit(f"{path}: the bytes at {offset} are not back as they were")
        os.unlink(state_file)
        print(json.dumps({"reverted": path, "offset": offset, "length": length}))
        return 0
    if before == after:
        raise SystemExit("the reversed bytes equal the original ones: no change")
    state = {"file": path, "tensor": "lm_head.weight", "row": rows // 2, "offset": offset, "length": length,
             "change": f"{length // 2} bf16 values of one row reversed in place (same size)",
             "sha256_before": digest(before), "sha256_after": digest(after)}
    with open(state_file, "w") as f:
        json.dump(state, f)
    print(json.dumps(state))
    return 0


def probe(url, model, model_dir, out):
    """The logprob a server gives, after "The capital of France is", to the token whose lm_head row the
    changed-model test edits (logprob_token_ids): equal on servers of one model, different once that
    row changed, whatever the greedy tokens do."""
    _, _, size, row = _lm_head(model_dir)
    token = (size // row) // 2
    body = {"model": model, "prompt": "The capital of France is", "max_tokens": 1, "temperature": 0, "logprobs": 1,
            "logprob_token_ids": [token], "return_tokens_as_token_ids": True}
    doc = {"token": token, "logprob": None}
    try:
        top = post(url, body, 60)["choices"][0]["logprobs"]["top_logprobs"][0]
        doc["logprob"] = top.get(f"token_id:{token}")
    except (OSError, ValueError, KeyError, IndexError, TypeError) as exc:
        doc["error"] = f"{type(exc).__name__}: {exc}"[:300]
    with open(out, "w") as f:
        json.dump(doc, f)
    print(json.dumps(doc))
    return 0 if doc["logprob"] is not None else 1


def pids(snapshot_dir):
    """The captured process tree of a vllm snapshot (root first), from its manifest."""
    print(" ".join(str(p) for p in json.load(open(os.path.join(snapshot_dir, "manifest.json")))["process_tree"]))
    return 0


def jget(path, *keys):
    """A value of a JSON document (the last JSON object in the file), or nothing."""
    text = open(path, errors="replace").read()
    doc = None
    for start in [i for i, c in enumerate(text) if c == "{" and (i == 0 or text[i - 1] == "\n")][::-1]:
        try:
            doc = json.loads(text[start:])
            break
        except ValueError:
            continue
    for key in keys:
        if not isinstance(doc, dict) or key not in doc:
            return 1
        doc = doc[key]
    print(doc if isinstance(doc, str) else json.dumps(doc))
    return 0


# ---- the record ----------------------------------------------------------------------------------

def _nest(kv_file):
    """KEY<TAB>VALUE lines into one document (a later line wins). "#run" lines start each run of the
    script: results of earlier runs on this machine stay, their errors and skips are dropped."""
    doc = {}
    lines = open(kv_file, errors="replace").read().splitlines()
    last_run = max((i for i, line in enumerate(lines) if line.startswith("#run")), default=0)
    for i, line in enumerate(lines):
        if "\t" not in line:
            continue
        key, value = line.split("\t", 1)
        if i < last_run and key.startswith(("errors.", "skipped.")):
            continue
        if value.startswith("@"):
            try:
                value = json.load(open(value[1:]))
            except (OSError, ValueError) as exc:
                value = f"unreadable {value[1:]}: {exc}"
        else:
            try:
                value = json.loads(value)
            except ValueError:
                pass
        node = doc
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                break
        else:
            node[parts[-1]] = value
    return doc


def _g(doc, path, default=None):
    for key in path.split("."):
        if not isinstance(doc, dict) or key not in doc:
            return default
        doc = doc[key]
    return doc


def _s(value, unit="s", digits=2):
    if value is None:
        return "-"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return f"{value:.{digits}f} {unit}".strip()
    return str(value)


def _outputs(c):
    if not isinstance(c, dict):
        return "-"
    return (f"{c['mismatched_prompts']} of {c['prompts']} prompts differ"
            + (f" (first at token {c['first_mismatch_position']})" if c["mismatched_prompts"] else "")
            + f"; largest logprob difference {c['max_logprob_diff']:.2g}")


def _load(l):
    if not isinstance(l, dict):
        return "-"
    return (f"{l['tokens_per_s']} tokens/s, {l['requests_per_s']} req/s, p50 {l['latency_p50_s']} s "
            f"({l['concurrency']} x {l['max_tokens']} tokens, {l['seconds']} s, {l['errors']} errors)")


def _refusal(r):
    if not isinstance(r, dict):
        return r if isinstance(r, str) else "-"
    parts = [r.get("result", "-"), r.get("message") or "", r.get("detail") or ""]
    return "; ".join(p for p in parts if p)[:500]


def record(kv_file, out_dir):
    doc = _nest(kv_file)
    doc["format"] = "vsnap side-by-side record 1"
    v, s = doc.get("vllm", {}), doc.get("vsnap", {})
    vr, sr = _g(v, "restore.first_completion_s"), _g(s, "restore.first_completion_s")
    if isinstance(vr, (int, float)) and isinstance(sr, (int, float)) and vr > 0:
        doc["goal"] = {"vsnap_over_vllm": round(sr / vr, 3), "at_most_half": sr <= vr / 2}
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "side-by-side.json"), "w") as f:
        json.dump(doc, f, indent=2, sort_keys=True, default=str)
    cold = doc.get("cold", {})
    rows = [
        ("capture: the command's wall time", _s(_g(v, "create.seconds")), _s(_g(s, "capture.seconds"))),
        ("artifact size (du)", _s(_g(v, "artifact.du_bytes", 0) / 1e9 if _g(v, "artifact.du_bytes") else None, "GB"),
         _s(_g(s, "image.du_bytes", 0) / 1e9 if _g(s, "image.du_bytes") else None, "GB")),
        ("restore: the command returned", _s(_g(v, "restore.command_s")), _s(_g(s, "restore.command_s"))),
        ("restore: port open (from the command's start)", _s(_g(v, "restore.port_open_s")), _s(_g(s, "restore.port_open_s"))),
        ("**restore to first completion** (from the command's start, over HTTP)", _s(vr), _s(sr)),
        ("what the restore proves before serving", _g(v, "proves", "-"), _g(s, "proves", "-")),
        ("outputs: 32 prompts x 16 greedy tokens vs the cold server", _outputs(_g(v, "outputs_vs_cold")),
         _outputs(_g(s, "outputs_vs_cold"))),
        ("throughput after restore", _load(_g(v, "load")), _load(_g(s, "load"))),
        ("GPU memory held while serving (nvidia-smi memory.used)", _s(_g(v, "gpu_used_mib"), "MiB", 0),
         _s(_g(s, "gpu_used_mib"), "MiB", 0)),
        ("refuses: a second restore at once", _refusal(_g(v, "refusals.second_restore")), _refusal(_g(s, "refusals.second_restore"))),
        ("refuses: another GPU", _refusal(_g(v, "refusals.another_gpu")), _refusal(_g(s, "refusals.another_gpu"))),
        ("refuses: a changed model file", _refusal(_g(v, "refusals.changed_model")), _refusal(_g(s, "refusals.changed_model"))),
    ]
    md = ["| | `vllm snapshot` (vLLM " + str(_g(doc, "host.vllm", "?")) + ") | vsnap |", "|---|---|---|"]
    md += [f"| {a} | {str(b).replace('|', '/')} | {str(c).replace('|', '/')} |" for a, b, c in rows]
    md += ["", f"Cold `vllm serve` (fully cold compile cache) to its first completion: "
               f"{_s(_g(cold, 'first_completion_s'))}; its throughput: {_load(_g(cold, 'load'))}."]
    if "goal" in doc:
        md.append(f"Goal (vsnap's restore to first completion at most half of vllm snapshot's): "
                  f"{doc['goal']['vsnap_over_vllm']:.2f} of it, {'met' if doc['goal']['at_most_half'] else 'NOT met'}.")
    for key in ("skipped", "errors"):
        for name, why in sorted((doc.get(key) or {}).items()):
            md.append(f"{key[:-1] if key == 'errors' else key}: {name}: {why}")
    text = "\n".join(md) + "\n"
    with open(os.path.join(out_dir, "side-by-side.md"), "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    name, *args = sys.argv[1:]
    sys.exit(globals()[name](*args))
PYHELPER

HPY=("$PY" "$HELPER")
H() { "${HPY[@]}" "$@"; }

# the processes of one session (a setsid'd server, a restored vllm tree, whose root leads its session)
session_pids() { ps -eo pid=,sid= | awk -v s="$1" '$2 == s { print $1 }'; }
kill_session() {  # SID: TERM, then KILL what is left after 30 s
  local sid=$1 i pids=()
  mapfile -t pids < <(session_pids "$sid"); [ ${#pids[@]} -gt 0 ] || return 0
  kill -TERM "${pids[@]}" 2>/dev/null
  for ((i = 0; i < 60; i++)); do mapfile -t pids < <(session_pids "$sid"); [ ${#pids[@]} -gt 0 ] || return 0; sleep 0.5; done
  log "session $sid still alive after 30 s: KILL ${pids[*]}"; kill -KILL "${pids[@]}" 2>/dev/null; sleep 1
}
# The last resort, at the start and in the cleanup: a process whose command line names $WORK/ (a
# vllm snapshot server, a vsnap engine tree, left by a timeout's KILL or an earlier run) outside this
# script's own session: its whole session ends. Everything naming $WORK/ was started by this script.
sweep() {
  local me sid p
  me=$(ps -o sid= -p $$ | tr -d ' ')
  for sid in $(for p in /proc/[0-9]*; do
                 tr '\0' ' ' < "$p/cmdline" 2>/dev/null | grep -qF "$WORK/" && ps -o sid= -p "${p#/proc/}"
               done | tr -d ' ' | sort -u); do
    [ "$sid" = "$me" ] || { log "sweep: ending session $sid (a command line in it names $WORK/)"; kill_session "$sid"; }
  done
}
gpu_pids() { timeout 20 nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null | sed '/^\s*$/d'; }
wait_gpu_idle() {  # SECONDS: until no process holds the GPU
  local i; for ((i = 0; i < $1 * 2; i++)); do [ -z "$(gpu_pids)" ] && return 0; sleep 0.5; done
  log "the GPU is still held after $1 s by: $(gpu_pids | tr '\n' ' ')"; return 1
}
gpu_used() { timeout 20 nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits 2>/dev/null | head -1 | tr -d ' '; }
gpu_apps() { timeout 20 nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits 2>/dev/null | tr '\n' ';'; }
# why FILE: what a failed command said (vsnap --json: its message; vllm: its exception's line)
why() { { H jget "$1" message 2>/dev/null ||
          grep -E "Error|error|refus|mismatch|occupied|denied|Traceback" "$1" | grep -v "^Traceback" | tail -1 ||
          tail -1 "$1"; } 2>/dev/null | tail -1 | cut -c1-400; }
# outputs_vs_cold NAME PORT KEY: the 32 x 16 outputs of a server, compared with the cold ones
outputs_vs_cold() {
  [ -s "$RES/cold-outputs.json" ] || return 1
  if timeout 180 "${HPY[@]}" outputs "http://127.0.0.1:$2" "$REPO_ID" "$RES/$1-outputs.json" > "$LOGS/$1-outputs.log" 2>&1 &&
     H compare "$RES/cold-outputs.json" "$RES/$1-outputs.json" "$RES/$1-vs-cold.json"; then
    putf "$3" "$RES/$1-vs-cold.json"
  else
    fail "$1_outputs" "$(tail -3 "$LOGS/$1-outputs.log")"; return 1
  fi
}
load_test() {  # NAME PORT KEY
  fits $((LOAD_S + 15)) "$1_load" || return 0
  timeout $((LOAD_S + 150)) "${HPY[@]}" load "http://127.0.0.1:$2" "$REPO_ID" "$LOAD_S" "$LOAD_CONC" "$LOAD_TOKENS" \
    "$RES/$1-load.json" && putf "$3" "$RES/$1-load.json"
}
# verdict FILE RESULT-IF-REFUSED RESULT-IF-SERVED [DETAIL]: a refusal test's line, from a restore's result
verdict() {
  "$PY" - "$@" <<'PYV'
import json, sys
d = json.load(open(sys.argv[1]))
print(json.dumps({"result": sys.argv[2] if d["rc"] else sys.argv[3], "rc": d["rc"], "message": d.get("message", ""),
                  "detail": sys.argv[4] if len(sys.argv) > 4 else "", "command_s": d.get("command_s"),
                  "first_completion_s": d.get("first_completion_s")}))
PYV
}
# result NAME RC SECONDS MESSAGE-FILE [vsnap --json output]: one restore's result document
result() {
  "$PY" - "$RES/$1-first.json" "$2" "$3" "$(why "$4")" "${5:-}" "$RES/$1-port.json" > "$RES/$1.json" <<'PYR'
import json, sys
doc = json.load(open(sys.argv[1]))
doc.update(rc=int(sys.argv[2]), command_s=float(sys.argv[3]))
try:  # the port as seen while the command ran (first() polls only after it returned)
    early = json.load(open(sys.argv[6]))["port_open_s"]
    if doc.get("port_open_s") is None or early < doc["port_open_s"]:
        doc["port_open_s"] = early
except (OSError, ValueError, KeyError, TypeError):
    pass
if sys.argv[5]:
    try:
        out = json.load(open(sys.argv[5]))
        doc.update({k: out[k] for k in ("timings", "total_s", "command_start_s", "instance", "instance_dir", "gpu")
                    if k in out})
    except (OSError, ValueError):
        pass
if doc["rc"]:
    doc["message"] = sys.argv[4]
print(json.dumps(doc))
PYR
  cat "$RES/$1.json"
}
# restore_vllm NAME PORT [VAR=VALUE...]: `vllm snapshot restore`, timed from its start to its return
# and to the first completion; $RES/vllm-NAME.json; its exit status
restore_vllm() {
  local name=vllm-$1 port=$2 t rc poller; shift 2  # the poller: python itself (not via H), so that kill ends it
  t=$(now)
  rm -f "$RES/$name-port.json"; "${HPY[@]}" port_open "http://127.0.0.1:$port" "$t" 300 > "$RES/$name-port.json" 2>/dev/null & poller=$!
  timeout --kill-after=20 "$(cap 240)" "${VLLM_ENV[@]}" "$@" "${VLLM_CLI[@]}" snapshot restore "$SNAP" \
    --host 127.0.0.1 --port "$port" > "$LOGS/$name.log" 2>&1; rc=$?
  local took; took=$(secs "$t" "$(now)")
  if [ $rc = 0 ]; then VLLM_ROOT=$(H pids "$SNAP" | cut -d" " -f1); H first "http://127.0.0.1:$port" "$REPO_ID" "$t" 120 > "$RES/$name-first.json"
  else echo '{}' > "$RES/$name-first.json"; fi
  kill "$poller" 2>/dev/null; wait "$poller" 2>/dev/null
  result "$name" "$rc" "$took" "$LOGS/$name.log"
  return $rc
}
# restore_vsnap NAME PORT [args...]: `vsnap restore --detach --json`, timed the same way
restore_vsnap() {
  local name=vsnap-$1 port=$2 t rc poller; shift 2
  t=$(now)
  rm -f "$RES/$name-port.json"; "${HPY[@]}" port_open "http://127.0.0.1:$port" "$t" 300 > "$RES/$name-port.json" 2>/dev/null & poller=$!
  timeout --kill-after=20 "$(cap 180)" "${VSNAP[@]}" restore "$IMAGE" --port "$port" --detach --json "$@" \
    > "$RES/$name-out.json" 2> "$LOGS/$name.err"; rc=$?
  local took; took=$(secs "$t" "$(now)")
  if [ $rc = 0 ]; then VSNAP_LIVE=1; H first "http://127.0.0.1:$port" "$REPO_ID" "$t" 120 > "$RES/$name-first.json"
  else echo '{}' > "$RES/$name-first.json"; fi
  kill "$poller" 2>/dev/null; wait "$poller" 2>/dev/null
  result "$name" "$rc" "$took" "$RES/$name-out.json" "$RES/$name-out.json"
  return $rc
}
stop_vllm() { [ -n "$VLLM_ROOT" ] && { kill_session "$VLLM_ROOT"; VLLM_ROOT=""; }; wait_gpu_idle 60; }
stop_vsnap() { [ "$VSNAP_LIVE" = 1 ] && timeout 90 "${VSNAP[@]}" stop "$IMAGE" --json >> "$LOGS/vsnap-stop.json" 2>&1; VSNAP_LIVE=0; wait_gpu_idle 60; }
change_model() { H modify "$MODEL_DIR" "$WORK/modified.json" >> "$LOGS/modify.log" 2>&1 || { fail modify "$(tail -2 "$LOGS/modify.log")"; return 1; }; }
restore_model() {
  [ -f "$WORK/modified.json" ] || return 0
  H modify "$MODEL_DIR" "$WORK/modified.json" --revert >> "$LOGS/modify.log" 2>&1 || fail modify_revert "$(tail -2 "$LOGS/modify.log")"
}

# shellcheck disable=SC2317  # run by the EXIT trap
cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  log "cleanup (exit $rc)"
  [ -n "$MODEL_PID" ] && kill "$MODEL_PID" 2>/dev/null
  [ "$ENV_OK" = 1 ] || [ "$rc" = 0 ] || grep -q "^errors\.env" "$RES/kv.tsv" || fail env "the environment step exited $rc (run.log)"
  [ -n "$COLD_SID" ] && kill_session "$COLD_SID"
  [ -n "$VLLM_ROOT" ] && kill_session "$VLLM_ROOT"
  [ "$VSNAP_LIVE" = 1 ] && timeout 90 "${VSNAP[@]}" stop "$IMAGE" --json >> "$LOGS/vsnap-stop.json" 2>&1
  sweep
  restore_model
  put run "{\"seconds\": $(secs "$START" "$(now)"), \"exit\": $rc, \"budget_s\": $BUDGET_S}"
  for f in "$LOGS"/*; do  # keep the tarball far under the device tool's 16 MiB a file
    [ -f "$f" ] && [ "$(stat -c %s "$f")" -gt 2000000 ] && { tail -c 2000000 "$f" > "$f.tail" && mv "$f.tail" "$f"; }
  done
  tar -C "$WORK" -czf "$RESULTS/logs.tgz" logs res 2>/dev/null
  echo; echo "=== side by side (record: $RESULTS/side-by-side.json, logs: $RESULTS/logs.tgz)"
  timeout 60 "$PY" "$HELPER" record "$RES/kv.tsv" "$RESULTS" || echo "the record could not be written"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# ---- 0. environment, host facts ------------------------------------------------------------------------
log "0. environment (${ENV_SCRIPT:-scripts/gpu-env.sh}, VLLM_SITE=$VLLM_SITE)"
[ -f "$VLLM_SITE/.vsnap-installed" ] || { fail env "no vLLM 0.33 in $VLLM_SITE: run scripts/gpu-install-vllm033.sh first"; exit 10; }
[ -x "$CKPT_DIR/cuda-checkpoint" ] || { fail env "no $CKPT_DIR/cuda-checkpoint: carry .carry/cuda-checkpoint"; exit 10; }
command -v ps > /dev/null || { fail env "no ps (vllm snapshot's inventory and this script need it)"; exit 10; }
# This run needs ~45 GB of the 64 GiB disk (model 16, vllm artifact, vsnap image ~21). On a machine kept
# warm since gpu-e2e.sh / gpu-bench.sh, their 8B model and images (~16 + 20 GB) would leave too little:
# that scratch (remade by those scripts when absent) goes first.
if [ "$(df -B1G --output=avail /tmp | tail -1 | tr -dc 0-9)" -lt 50 ] && { [ -e /tmp/vsnap-gpu/images ] || [ -e /tmp/models ]; }; then
  log "$(df -h --output=avail /tmp | tail -1 | tr -d ' ') free: removing the other GPU scripts' scratch (/tmp/vsnap-gpu/images, /tmp/models)"
  put host.removed_for_disk "$(jstr "$(du -sh /tmp/vsnap-gpu/images /tmp/models 2>/dev/null | tr '\t\n' ' ;')")"
  rm -rf /tmp/vsnap-gpu/images /tmp/models
fi
if [ "$(cat "$WORK/model.ok" 2>/dev/null)" != "$REV" ]; then  # step 1 starts now, beside step 0 (GPU and disk vs CPU)
  log "1. the 8B model into $MODEL_DIR (in the background)"
  rm -rf "$WORK/hf" "$WORK/model.ok" "$WORK/modified.json" && mkdir -p "$MODEL_DIR" && T_MODEL=$(now)
  timeout 300 env -u PYTHONPATH "$PY" scripts/make_test_model.py "$MODEL_DIR" --shape 8b > "$LOGS/model.log" 2>&1 &
  MODEL_PID=$!
fi
# shellcheck source=scripts/gpu-env.sh
. "${ENV_SCRIPT:-$REPO/scripts/gpu-env.sh}"
ENV_OK=1
# One environment for every vLLM command: vllm snapshot hashes the VLLM_/CUDA_/NCCL_/TORCH_/TRITON_
# variables into its artifact and refuses a restore under others. HF: offline, the cache layout above.
export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 VLLM_HOST_IP=127.0.0.1 VLLM_CACHE_ROOT=/var/cache/vsnap/vllm \
  HF_HOME=$WORK/hf HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 PYTHONUNBUFFERED=1
mkdir -p "$VLLM_CACHE_ROOT"
# only the vllm commands see cuda-checkpoint and the carried criu on PATH, and the CUDA plugin's dir
VLLM_ENV=(env "PATH=$CKPT_DIR:$CRIU_BUNDLE/bin:$PATH" "CRIU_CUDA_PLUGIN_DIR=$CRIU_BUNDLE/lib/criu" VLLM_SNAPSHOT_TIMEOUT_S=300)
put host.cuda_checkpoint_on_path_before "$(jstr "$(command -v cuda-checkpoint || echo none)")"
if [ ! -s /etc/machine-id ]; then  # vllm snapshot's identity reads it (create fails after its dump without one)
  tr -d '-' < /proc/sys/kernel/random/uuid > /etc/machine-id && put host.machine_id '"written by this script"'
else put host.machine_id '"present"'; fi
GPU_UUID=$(timeout 20 nvidia-smi --query-gpu=uuid --format=csv,noheader | head -1 | tr -d ' ')
# the same GPU under another name, for vllm's "another GPU" test (its identity hashes CUDA_VISIBLE_DEVICES)
if [ "${CUDA_VISIBLE_DEVICES:-}" = "$GPU_UUID" ]; then OTHER_CVD=0; else OTHER_CVD=$GPU_UUID; fi
{ timeout 20 nvidia-smi --query-gpu=name,uuid,driver_version,memory.total --format=csv,noheader
  echo "kernel $(uname -r), $("$PY" --version 2>&1)"
  "$PY" -c 'import importlib.metadata as m; print("vllm", m.version("vllm"), "torch", m.version("torch"))' 2>&1 | tail -1
  "$CRIU_BUNDLE/bin/criu" --version | head -1
  echo "cuda-checkpoint sha256 $(sha256sum < "$CKPT_DIR/cuda-checkpoint" | cut -d' ' -f1)"
  echo "pid_max $(cat /proc/sys/kernel/pid_max), io_uring_disabled $(cat /proc/sys/kernel/io_uring_disabled 2>/dev/null)"
  echo "/proc/driver/nvidia/gpus: $(find /proc/driver/nvidia/gpus -mindepth 1 -maxdepth 1 2>&1 | tr '\n' ' ')"  # CRIU's CUDA plugin turns off without it
  echo "CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES-unset}"
  echo "disk free on $WORK: $(df -h --output=avail "$WORK" | tail -1 | tr -d ' ')"
} > "$LOGS/host.txt" 2>&1
timeout 20 "$CKPT_DIR/cuda-checkpoint" --help > "$LOGS/cuda-checkpoint-help.txt" 2>&1; ckrc=$?
cat "$LOGS/host.txt"; echo "cuda-checkpoint --help: rc $ckrc, $(head -2 "$LOGS/cuda-checkpoint-help.txt" | tr '\n' ' ')"
put host.facts "$("$PY" -c 'import json,sys; print(json.dumps(open(sys.argv[1]).read().splitlines()))' "$LOGS/host.txt")"
put host.cuda_checkpoint_help "$(jstr "rc $ckrc: $(head -3 "$LOGS/cuda-checkpoint-help.txt" | tr '\n' ' ')")"
put host.vllm "$(jstr "$("$PY" -c 'import importlib.metadata as m; print(m.version("vllm"))' 2>&1 | tail -1)")"
put host.gpu_uuid "\"$GPU_UUID\""
put host.cuda_checkpoint "$(jstr "NVIDIA/cuda-checkpoint commit 6ec728aff032, bin/x86_64_Linux/cuda-checkpoint")"
put host.criu "$(jstr "$(tar xzf "$REPO/.carry/criu/criu-bundle.tar.gz" -O criu-bundle/BUILDINFO | tr '\n' ';')")"
put vllm_args "$(jstr "$REPO_ID ${VLLM_ARGS[*]} (both snapshot paths add --enable-sleep-mode; the cold server is given it)")"
# left by an earlier run on this machine: a model change not put back, servers still holding the GPU
sweep
restore_model
[ -n "$(gpu_pids)" ] && log "the GPU is held at the start by: $(gpu_apps)"

# ---- 1. the model, in a Hugging Face cache layout ---------------------------------------------------------
put model "{\"repo\": \"$REPO_ID\", \"revision\": \"$REV\", \"dir\": \"$MODEL_DIR\", \"shape\": \"8b\"}"
if [ -n "$MODEL_PID" ]; then
  wait "$MODEL_PID"; rc=$?; MODEL_PID=""
  [ $rc = 0 ] || { fail model "rc $rc: $(tail -3 "$LOGS/model.log")"; exit 12; }
  echo "$REV" > "$WORK/model.ok"; put model_write_s "$(secs "$T_MODEL" "$(now)")"; log "$(tail -1 "$LOGS/model.log")"
fi
put model_bytes "$(du -sb "$MODEL_DIR" | cut -f1)"

# ---- 2. the cold server: the reference ----------------------------------------------------------------------
AHEAD=$((110 + 25 + 125 + 10))   # expected: vllm create and restore, vsnap capture and restore
if want 2 && [ ! -s "$RES/cold-outputs.json" ] && fits 140 cold; then
  log "2. cold vllm serve (fully cold compile cache) to its first completion"
  T=$(now)
  setsid "${VLLM_CLI[@]}" serve "$REPO_ID" "${VLLM_ARGS[@]}" --enable-sleep-mode --host 127.0.0.1 --port $PORT_COLD \
    > "$LOGS/cold-serve.log" 2>&1 < /dev/null &
  COLD_SID=$!
  H first "http://127.0.0.1:$PORT_COLD" "$REPO_ID" "$T" "$(cap 300)" "$COLD_SID" > "$RES/cold-first.json"; rc=$?
  putf cold "$RES/cold-first.json"; cat "$RES/cold-first.json"
  if [ $rc = 0 ]; then
    put cold.gpu_used_mib "$(gpu_used)"
    timeout 70 "${HPY[@]}" probe "http://127.0.0.1:$PORT_COLD" "$REPO_ID" "$MODEL_DIR" "$RES/cold-probe.json" && putf cold.probe "$RES/cold-probe.json"
    if timeout 180 "${HPY[@]}" outputs "http://127.0.0.1:$PORT_COLD" "$REPO_ID" "$RES/cold-outputs.tmp" > "$LOGS/cold-outputs.log" 2>&1; then
      mv "$RES/cold-outputs.tmp" "$RES/cold-outputs.json"
    else fail cold_outputs "$(tail -3 "$LOGS/cold-outputs.log")"; fi
    [ "${COLD_LOAD:-0}" = 1 ] && load_test cold $PORT_COLD cold.load
  else
    fail cold "no completion from the cold server (rc $rc): $(tail -5 "$LOGS/cold-serve.log")"
  fi
  kill_session "$COLD_SID"; COLD_SID=""; wait_gpu_idle 60
fi
[ -s "$RES/cold-outputs.json" ] || log "no cold reference outputs: the comparisons will be missing"

# ---- 3. vllm snapshot create ----------------------------------------------------------------------------------
put vllm.proves "$(jstr "before CRIU: the manifest, and an exact identity (vLLM, Python, torch, CUDA runtime, driver, CRIU version, cuda-checkpoint's sha256, kernel, machine id, GPU name and UUID, hashes of the VLLM_/CUDA_/NCCL_/TORCH_/TRITON_ variables, the CRIU plugins' sha256), the captured PIDs free, the cache files the tree held open unchanged; no model file is checked. After CRIU (the CUDA restore by CRIU's plugin): the restored PIDs and session pinned, the root's command checked; the saved engine is released: weights reloaded from the model's files, KV cache woken, HTTP bound; then 1 prompt x 1 greedy token over HTTP (token id, text, logprob within 1e-3), with the port already open")"
AHEAD=$((25 + 125 + 10))
if want 3 && [ ! -f "$SNAP/manifest.json" ] && fits 115 vllm_create; then
  log "3. vllm snapshot create"
  rm -rf "$SNAP"; mkdir -p "$(dirname "$SNAP")" && chmod 700 "$(dirname "$SNAP")"
  T=$(now)
  timeout --kill-after=20 "$(cap 420)" "${VLLM_ENV[@]}" "${VLLM_CLI[@]}" snapshot create "$REPO_ID" --snapshot-dir "$SNAP" \
    "${VLLM_ARGS[@]}" > "$LOGS/vllm-create.log" 2>&1; rc=$?
  put vllm.create "{\"seconds\": $(secs "$T" "$(now)"), \"rc\": $rc}"
  [ $rc = 0 ] || fail vllm_create "rc $rc: $(why "$LOGS/vllm-create.log")"
  cp "$SNAP/child.log" "$LOGS/vllm-create-child.log" 2>/dev/null
  cp "$SNAP/images/dump.log" "$LOGS/vllm-criu-dump.log" 2>/dev/null
  wait_gpu_idle 30
fi
if [ -f "$SNAP/manifest.json" ]; then
  timeout 120 "${VLLM_ENV[@]}" "${VLLM_CLI[@]}" snapshot inspect "$SNAP" > "$LOGS/vllm-inspect.json" 2> "$LOGS/vllm-inspect.err"
  put vllm.artifact "{\"du_bytes\": $(du -sb "$SNAP" | cut -f1), \"criu_images_bytes\": $(du -sb "$SNAP/images" | cut -f1), \"manifest_artifact_bytes\": $(H jget "$LOGS/vllm-inspect.json" artifact_bytes || echo null)}"
  put vllm.oracle "{\"text\": $(jstr "$(H jget "$LOGS/vllm-inspect.json" oracle_text)"), \"token_ids\": $(H jget "$LOGS/vllm-inspect.json" oracle_token_ids || echo null)}"
  VLLM_PIDS=$(H pids "$SNAP"); log "vllm snapshot: $(du -sh "$SNAP" | cut -f1), process tree $VLLM_PIDS"
fi

# ---- 4. vllm snapshot restore: what it serves, what it refuses ----------------------------------------------------
AHEAD=$((125 + 10))
if want 4 && [ -f "$SNAP/manifest.json" ] && fits 25 vllm_restore; then
  log "4. vllm snapshot restore"
  restore_vllm restore $PORT_VLLM; rc=$?
  putf vllm.restore "$RES/vllm-restore.json"
  cp "$SNAP/images/restore.log" "$LOGS/vllm-criu-restore.log" 2>/dev/null
  if [ $rc = 0 ]; then
    put vllm.gpu_used_mib "$(gpu_used)"; put vllm.gpu_apps "\"$(gpu_apps)\""
    outputs_vs_cold vllm $PORT_VLLM vllm.outputs_vs_cold
    timeout 70 "${HPY[@]}" probe "http://127.0.0.1:$PORT_VLLM" "$REPO_ID" "$MODEL_DIR" "$RES/vllm-probe.json" && putf vllm.probe "$RES/vllm-probe.json"
    load_test vllm $PORT_VLLM vllm.load
    if fits 8 vllm_second_restore; then
      log "4b. a second vllm snapshot restore while the first serves (another port)"
      restore_vllm second $PORT_VLLM2
      verdict "$RES/vllm-second.json" refused "served" > "$RES/vllm-refuse-second.json"
      putf vllm.refusals.second_restore "$RES/vllm-refuse-second.json"
    fi
    if fits 8 vllm_other_gpu; then
      log "4c. vllm snapshot restore with CUDA_VISIBLE_DEVICES=$OTHER_CVD (the same GPU, named otherwise)"
      restore_vllm other-gpu $PORT_VLLM2 "CUDA_VISIBLE_DEVICES=$OTHER_CVD"
      verdict "$RES/vllm-other-gpu.json" "refused: the same GPU under CUDA_VISIBLE_DEVICES=$OTHER_CVD" "served under CUDA_VISIBLE_DEVICES=$OTHER_CVD" \
        "another GPU is not testable on one GPU; vllm snapshot restore takes no GPU option, and its identity pins the GPU's UUID and the CUDA_* variables" \
        > "$RES/vllm-refuse-gpu.json"
      putf vllm.refusals.another_gpu "$RES/vllm-refuse-gpu.json"
    fi
  else
    fail vllm_restore "$(why "$LOGS/vllm-restore.log")"
  fi
  stop_vllm
  for p in $VLLM_PIDS; do [ -d "/proc/$p" ] && log "a captured PID is alive after the stop: $p ($(tr '\0' ' ' < "/proc/$p/cmdline" | cut -c1-80))"; done
fi

# ---- 5. vsnap capture -------------------------------------------------------------------------------------------------
# The same revision as the vllm commands: vLLM hashes it (not the served name) into its compile-cache key,
# so with it vsnap's boot loads the graph the cold server compiled, as vllm snapshot's boot does. Without it
# (session 15's first run) vsnap's boot compiled a graph of its own, whose logits differed from the cold
# server's by one bf16 ulp here and there: 18 of 32 random-weight prompts took another greedy token.
cat > "$SPEC" <<YAML
name: sbs-8b
engine: vllm
model: $MODEL_DIR
image: $IMAGE
serve:
  served_model_name: $REPO_ID
  revision: $REV
  tokenizer_revision: $REV
  max_model_len: $MAX_LEN
  gpu_memory_utilization: $GPU_UTIL
snapshot:
  control_dir: $WORK/control/sbs-8b
  timeout_s: 600
oracle:
  tolerance: 0.001
YAML
AVAIL=$(df -B1 --output=avail "$WORK" | tail -1)
if [ ! -f "$IMAGE/manifest.json" ] && [ -d "$SNAP" ] && [ "$AVAIL" -lt $((30 * 1024 ** 3)) ]; then
  log "$((AVAIL / 1024 ** 3)) GB free: the vllm artifact goes (its tests are done), the vsnap image needs ~21 GB"
  put vllm.artifact_removed_for_disk true; rm -rf "$SNAP"
fi
AHEAD=10
if want 5 && [ ! -f "$IMAGE/manifest.json" ] && fits 125 vsnap_capture; then
  log "5. vsnap capture"
  T=$(now)
  timeout --kill-after=20 "$(cap 420)" "${VSNAP[@]}" capture "$SPEC" --force --json > "$RES/vsnap-capture-out.json" \
    2> "$LOGS/vsnap-capture.err"; rc=$?
  put vsnap.capture "{\"seconds\": $(secs "$T" "$(now)"), \"rc\": $rc}"
  putf vsnap.capture_doc "$RES/vsnap-capture-out.json"
  if [ $rc != 0 ]; then
    fail vsnap_capture "rc $rc: $(why "$RES/vsnap-capture-out.json")"
    tail -80 "$WORK/control/sbs-8b".instances/capture-*/engine.log > "$LOGS/vsnap-capture-engine.log" 2>/dev/null
  fi
  cp "$IMAGE/logs/engine.log" "$LOGS/vsnap-capture-engine.log" 2>/dev/null
  wait_gpu_idle 30
fi
if [ -f "$IMAGE/manifest.json" ]; then
  put vsnap.image "{\"du_bytes\": $(du -sb "$IMAGE" | cut -f1)}"
  timeout 60 "${VSNAP[@]}" inspect "$IMAGE" --json > "$LOGS/vsnap-inspect.json" 2>&1
  put vsnap.proves "$(jstr "$("$PY" - "$LOGS/vsnap-inspect.json" <<'PYP'
import json, sys
try:
    m = json.load(open(sys.argv[1]))["manifest"]
    l = m["launch"]
    o = (f"{len(m['oracle']['samples'])} prompts x {l['oracle_max_tokens']} greedy tokens, top-{l['oracle_top_k']} "
         f"logprobs each, tolerance {l['oracle_tolerance']:g}")
except (OSError, ValueError, KeyError, TypeError):
    o = "the image's oracle"
print("before CRIU: the sha256 of every image file (once per file identity), the host's facts, every file the tree "
      "depends on (size, sha256: the model's files too), the port, the GPU's model and free memory; after the CUDA "
      f"restore and the weights: the oracle ({o}) inside the tree, before the port is bound")
PYP
)")"
fi

# ---- 6. vsnap restore: what it serves, a second instance, a changed model ------------------------------------------------
AHEAD=0
if want 6 && [ -f "$IMAGE/manifest.json" ] && fits 10 vsnap_restore; then
  log "6. vsnap restore"
  restore_vsnap restore $PORT_VSNAP; rc=$?
  putf vsnap.restore "$RES/vsnap-restore.json"
  if [ $rc = 0 ]; then
    put vsnap.gpu_used_mib "$(gpu_used)"; put vsnap.gpu_apps "\"$(gpu_apps)\""
    timeout 70 "${HPY[@]}" probe "http://127.0.0.1:$PORT_VSNAP" "$REPO_ID" "$MODEL_DIR" "$RES/vsnap-probe.json" && putf vsnap.probe "$RES/vsnap-probe.json"
    outputs_vs_cold vsnap $PORT_VSNAP vsnap.outputs_vs_cold &&
      [ -s "$RES/vllm-outputs.json" ] && H compare "$RES/vllm-outputs.json" "$RES/vsnap-outputs.json" "$RES/vsnap-vs-vllm.json" &&
      putf vsnap.outputs_vs_vllm_restored "$RES/vsnap-vs-vllm.json"
    load_test vsnap $PORT_VSNAP vsnap.load
    if fits 10 vsnap_second_restore; then
      log "6b. a second vsnap restore while the first serves (--gpu $GPU_UUID, another port)"
      restore_vsnap second $PORT_VSNAP2 --gpu "$GPU_UUID" && put vsnap.gpu_used_mib_two_instances "$(gpu_used)"
      verdict "$RES/vsnap-second.json" refused "served a second instance at once (the same GPU, named by --gpu UUID)" \
        > "$RES/vsnap-refuse-second.json"
      putf vsnap.refusals.second_restore "$RES/vsnap-refuse-second.json"
    fi
    put vsnap.refusals.another_gpu "$(jstr "not testable on one GPU: vsnap restore --gpu N restores onto another GPU (two H200s: docs/benchmarks/gpu-h200x2-multi-2026-11-30.md) and refuses another GPU model or too little free memory before CRIU")"
  else
    fail vsnap_restore "$(why "$RES/vsnap-restore-out.json")"
  fi
  instance_dir=$(H jget "$RES/vsnap-restore-out.json" instance_dir) && cp "$instance_dir/engine.log" "$LOGS/vsnap-restore-engine.log" 2>/dev/null
  stop_vsnap
  if [ -f "$IMAGE/manifest.json" ] && fits 8 vsnap_changed_model && change_model; then
    log "6c. vsnap restore of a changed model file"
    cp "$WORK/modified.json" "$RES/changed-model.json"; putf changed_model "$RES/changed-model.json"
    restore_vsnap changed $PORT_VSNAP
    verdict "$RES/vsnap-changed.json" "refused (its message says by what)" "SERVED the changed model" > "$RES/vsnap-refuse-changed.json"
    putf vsnap.refusals.changed_model "$RES/vsnap-refuse-changed.json"
    stop_vsnap; restore_model
  fi
fi

# ---- 7. vllm snapshot restore of the changed model file (the costliest optional step: last) --------------------
if want 7 && [ -f "$SNAP/manifest.json" ] && fits 30 vllm_changed_model && change_model; then
  log "7. vllm snapshot restore of a changed model file ($(H jget "$WORK/modified.json" change))"
  cp "$WORK/modified.json" "$RES/changed-model.json"; putf changed_model "$RES/changed-model.json"
  restore_vllm changed $PORT_VLLM; rc=$?
  detail=""
  if [ $rc = 0 ]; then
    timeout 70 "${HPY[@]}" probe "http://127.0.0.1:$PORT_VLLM" "$REPO_ID" "$MODEL_DIR" "$RES/vllm-changed-probe.json" &&
      putf vllm.changed_model_probe "$RES/vllm-changed-probe.json" &&
      detail="the changed row's token $(H jget "$RES/vllm-changed-probe.json" token): logprob $(H jget "$RES/vllm-changed-probe.json" logprob) served, $(H jget "$RES/cold-probe.json" logprob 2>/dev/null || echo '?') cold"
    fits 8 vllm_changed_outputs && outputs_vs_cold vllm-changed $PORT_VLLM vllm.changed_model_outputs_vs_cold &&
      detail="$detail; 32 x 16 greedy tokens against the cold server: $("$PY" -c 'import json,sys; c=json.load(open(sys.argv[1])); print("%d of %d prompts differ" % (c["mismatched_prompts"], c["prompts"]))' "$RES/vllm-changed-vs-cold.json")"
  fi
  verdict "$RES/vllm-changed.json" "refused (after CRIU; its message says by what)" "SERVED the changed model: its 1-token check passed" "$detail" \
    > "$RES/vllm-refuse-changed.json"
  putf vllm.refusals.changed_model "$RES/vllm-refuse-changed.json"
  stop_vllm; restore_model
fi
log "done: $(left) s of BUDGET_S=$BUDGET_S left"
exit 0
