#!/usr/bin/env bash
# `vsnap bench` on the GPU machine: SHAPE=tiny|8b, RUNS=3. The record goes to $OUT/bench/.
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
"$PY" -m vsnap bench "$SPEC" --runs "${RUNS:-3}" --out "$OUT/bench" 2>&1 | tail -40
rc=${PIPESTATUS[0]}
for d in "$WORK/control/bench-$SHAPE".instances/* "$WORK/control/bench-$SHAPE-bench".instances/*; do
  [ -f "$d/engine.log" ] && tail -30 "$d/engine.log" > "$OUT/bench/engine-$(basename "$d").log"
done
tar -C "$OUT/bench" -czf "$OUT/bench-$SHAPE.tgz" . 2>/dev/null
exit $rc
