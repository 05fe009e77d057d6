#!/usr/bin/env bash
# What holds GPU memory after vLLM's sleep level 2 (scripts/gpu_probe_sleep.py), then one vsnap
# capture and restore of the same model with the code as it is. SHAPE=tiny|8b (default tiny);
# logs and JSON under $OUT/probe-sleep/. Prints a short table last.
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO"
OUT=${OUT:-/tmp/vsnap-gpu-out}/probe-sleep
PY=${PY:-/opt/torch/.venv/bin/python3}
SHAPE=${SHAPE:-tiny}
WORK=/tmp/vsnap-gpu
mkdir -p "$OUT" "$WORK" && chmod 700 "$WORK"
. "$REPO/scripts/gpu-env.sh"
export VLLM_CACHE_ROOT=$WORK/probe-cache  # shared by the probes' compile runs
MODEL=/tmp/models/$SHAPE-llama
"$PY" scripts/make_test_model.py "$MODEL" --shape "$SHAPE" > /dev/null || exit 12
for mode in baseline compose graphs; do
  echo "[$(date +%T)] probe $mode"
  timeout 300 "$PY" scripts/gpu_probe_sleep.py $mode "$MODEL" > "$OUT/$mode.log" 2>&1
  echo "  rc=$?"; grep -h "^PROBE " "$OUT/$mode.log" | cut -c7- > "$OUT/$mode.json"
  grep -hE "CUDA graph pool memory|Graph capturing finished|non-torch|Sleep mode freed" "$OUT/$mode.log" | cut -c1-250
done
if [ "${CAPTURE:-1}" = 1 ]; then
  echo "[$(date +%T)] vsnap capture + restore ($SHAPE)"
  cat > "$WORK/probe-$SHAPE.yaml" <<YAML
name: probe-$SHAPE
engine: vllm
model: $MODEL
image: $WORK/images/probe-$SHAPE
serve:
  max_model_len: 2048
  gpu_memory_utilization: 0.5
snapshot:
  control_dir: $WORK/control/probe-$SHAPE
oracle:
  tolerance: 0.001
YAML
  IMAGE=$WORK/images/probe-$SHAPE
  timeout 400 "$PY" -m vsnap capture "$WORK/probe-$SHAPE.yaml" --force --json > "$OUT/capture.json" 2> "$OUT/capture.err"
  echo "  capture rc=$?"; tail -3 "$OUT/capture.err"
  cp "$IMAGE/logs/engine.log" "$OUT/capture-engine.log" 2>/dev/null
  grep -h "^vsnap:" "$OUT/capture-engine.log" | cut -c1-400
  if [ -f "$IMAGE/manifest.json" ]; then
    timeout 120 "$PY" -m vsnap restore "$IMAGE" --port 8013 --detach --json > "$OUT/restore.json" 2> "$OUT/restore.err"
    echo "  restore rc=$?"; tail -3 "$OUT/restore.err"
    timeout 60 "$PY" scripts/check_oracle.py "$IMAGE" http://127.0.0.1:8013 > "$OUT/check.json"; echo "  oracle over HTTP rc=$?"
    "$PY" -m vsnap stop "$IMAGE" --json > /dev/null
    "$PY" - "$IMAGE" "$OUT/restore.json" <<'PY'
import json, sys
from pathlib import Path
from vsnap import read_manifest
m = read_manifest(Path(sys.argv[1]))
print("image", {k: round(v / 1e9, 3) for k, v in m.sizes.items()}, "GB; timings", {k: round(v, 2) for k, v in m.timings.items()})
for p in m.processes:
    print(" ", p["command"][:40], "gpu", round(p.get("gpu_bytes", 0) / 1e6), "MB; anon", round(p["anonymous_bytes"] / 1e6), "MB")
try:
    r = json.load(open(sys.argv[2]))
    print("restore", {k: round(v, 3) for k, v in (r.get("timings") or {}).items() if isinstance(v, (int, float))})
except Exception as exc:
    print("restore json:", exc)
PY
  fi
fi
echo "== summary (MB)"
"$PY" - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
def load(name):
    try:
        return json.loads((out / f"{name}.json").read_text())
    except Exception:
        return {}
mb = lambda v: "-" if not isinstance(v, (int, float)) else f"{v / 1e6:.0f}"
b, c, g = load("baseline"), load("compose"), load("graphs")
print("| step | used MB |\n|---|---|")
for k in ("context", "context_cublas", "context_cublas_cleared"):
    print(f"| baseline {k} | {mb(b.get(k))} |")
for k in ("awake", "asleep", "gc_empty_cache", "cublas_cleared") + tuple(k for k in c if k.startswith("graphs_") and k.endswith("_dropped")):
    print(f"| vLLM {k} | {mb(c.get(k))} |")
print(f"| pools asleep | {json.dumps({k: mb(v) for k, v in (c.get('pools_asleep') or {}).items()})} |")
print(f"| graphs | {c.get('graphs')} in {c.get('graph_wrappers')} wrappers {c.get('graphs_by_mode')} |")
print(f"| graph pool in sleep allocator: awake | {mb(g.get('awake'))} |")
for name in ("graph_pool", "graph_pool_and_cublas"):
    r = g.get(name) or {}
    print(f"| {name}: tagged / asleep / cuBLAS freed | {mb(r.get('graph_pool_tagged'))} / {mb(r.get('asleep'))} / "
          f"{mb(r.get('asleep_cublas_cleared'))} |")
    print(f"| {name}: outputs equal after wake | {r.get('tokens_equal')} {r.get('max_logprob_diff')} |")
PY
tar -C "$OUT" -czf "$OUT/../probe-sleep-$SHAPE.tgz" . 2>/dev/null
