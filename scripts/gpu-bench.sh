#!/usr/bin/env bash
# `vsnap bench` on the GPU machine: SHAPE=tiny|8b, RUNS=3, COLD_RUNS=0 (0: RUNS-1), LAZY=1 (--lazy-pages). The record goes to $OUT/bench/.
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO"
OUT=${OUT:-/tmp/vsnap-gpu-out}
PY=${PY:-/opt/torch/.venv/bin/python3}
SHAPE=${SHAPE:-tiny}
WORK=/tmp/vsnap-gpu
mkdir -p "$OUT/bench" "$WORK" && chmod 700 "$WORK"
. "$REPO/scripts/gpu-env.sh"
MODEL=/tmp/models/$SHAPE-llama
"$PY" scripts/make_test_model.py "$MODEL" --shape "$SHAPE" || exit 12
SPEC=$WORK/bench-$SHAPE.yaml
cat > "$SPEC" <<YAML
name: $SHAPE-llama
engine: vllm
model: $MODEL
image: $WORK/images/bench-$SHAPE
serve:
  max_model_len: 2048
  gpu_memory_utilization: 0.5
snapshot:
  control_dir: $WORK/control/bench-$SHAPE
oracle:
  tolerance: 0.001
YAML
"$PY" -m vsnap bench "$SPEC" --runs "${RUNS:-3}" --cold-runs "${COLD_RUNS:-0}" ${LAZY:+--lazy-pages} --out "$OUT/bench" 2>&1 | tail -40
rc=${PIPESTATUS[0]}
# One more restore through the CLI, kept up long enough to read the engine's own timings.
IMAGE=$WORK/images/bench-$SHAPE
if [ $rc -eq 0 ]; then
  "$PY" -m vsnap restore "$IMAGE" --port 8012 --detach --json > "$OUT/bench/restore-cli.json" 2> "$OUT/bench/restore-cli.err"
  dir=$("$PY" -c "import json,sys; print(json.load(open(sys.argv[1]))['instance_dir'])" "$OUT/bench/restore-cli.json")
  "$PY" scripts/check_oracle.py "$IMAGE" http://127.0.0.1:8012 > "$OUT/bench/check-cli.json"; echo "oracle over HTTP rc=$?"
  grep -h "^vsnap:" "$IMAGE/logs/engine.log" "$dir/engine.log" | cut -c1-300
  "$PY" -m vsnap stop "$IMAGE" --json > /dev/null
fi
for d in "$WORK/control/bench-$SHAPE".instances/* "$WORK/control/bench-$SHAPE-bench".instances/*; do
  [ -f "$d/engine.log" ] && tail -30 "$d/engine.log" > "$OUT/bench/engine-$(basename "$d").log"
done
tar -C "$OUT/bench" -czf "$OUT/bench-$SHAPE.tgz" . 2>/dev/null
exit $rc
