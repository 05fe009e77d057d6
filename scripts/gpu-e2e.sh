#!/usr/bin/env bash
# One whole GPU run on the device machine: install the carried vLLM and CRIU, write a
# random-weight Llama, vsnap validate / capture / restore, check completions against the oracle
# over HTTP, restore a second time, and write a record. Prints a short table last.
#
#   bash scripts/gpu-e2e.sh            (SHAPE=tiny|8b, OUT=dir for logs and the record)
# The call must carry .carry/vllm-parts-00 and .carry/criu (see ../shared/device/README.md).
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO"
SHAPE=${SHAPE:-tiny}
RESULTS=${OUT:-/tmp/vsnap-gpu-out}   # the device tool brings back only a few files: all logs go
# TAG: SHAPE, "-ref" added with VSNAP_WEIGHTS_BY_REFERENCE=1 (a run of each in one call keeps both)
TAG=$SHAPE$([ "${VSNAP_WEIGHTS_BY_REFERENCE:-}" = 1 ] && echo -ref)
OUT=$RESULTS/run-$TAG                 # into run-TAG/, packed as TAG-logs.tgz at the end
PY=${PY:-/opt/torch/.venv/bin/python3}
PORT=${PORT:-8011}
RESTORE_ARGS=${RESTORE_ARGS:-}   # e.g. "--gpu 0": added to every restore and activate
WORK=/tmp/vsnap-gpu
mkdir -p "$OUT" "$WORK" && chmod 700 "$WORK"
log() { echo "[$(date +%H:%M:%S)] $*"; }

log "install vLLM and CRIU from the carry"
. "$REPO/scripts/gpu-env.sh"
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader > "$OUT/gpu-before.txt"

MODEL=/tmp/models/$SHAPE-llama
log "write the $SHAPE model to $MODEL"
"$PY" scripts/make_test_model.py "$MODEL" --shape "$SHAPE" || exit 12

IMAGE=$WORK/images/$SHAPE
SPEC=$WORK/$SHAPE.yaml
cat > "$SPEC" <<YAML
name: $SHAPE-llama
engine: vllm
model: $MODEL
image: $IMAGE
serve:
  max_model_len: 2048
  gpu_memory_utilization: ${GPU_UTIL:-0.5}
snapshot:
  control_dir: $WORK/control/$SHAPE
  timeout_s: 900
oracle:
  max_tokens: 8
  top_k: 5
  tolerance: 0.001
YAML

VSNAP=("$PY" -m vsnap)
log "vsnap validate"
"${VSNAP[@]}" validate "$SPEC" --json > "$OUT/validate.json" 2> "$OUT/validate.err"; echo "validate rc=$?"
log "vsnap capture"
"${VSNAP[@]}" capture "$SPEC" --force --json > "$OUT/capture.json" 2> "$OUT/capture.err"; rc=$?
echo "capture rc=$rc"; tail -5 "$OUT/capture.err"
if [ $rc -ne 0 ]; then
  tail -60 "$WORK/control/$SHAPE".instances/capture-*/engine.log > "$OUT/engine-capture-tail.log" 2>/dev/null
  cat "$OUT/capture.json"; tail -40 "$OUT/engine-capture-tail.log"; exit 20
fi
cp "$IMAGE/logs/engine.log" "$OUT/engine-capture.log"
grep "^vsnap:" "$OUT/engine-capture.log" | cut -c1-800  # the weights line's referenced_bytes come after ~420 characters
nvidia-smi --query-gpu=memory.used --format=csv,noheader > "$OUT/gpu-after-capture.txt"

for n in 1 2; do
  log "vsnap restore #$n"
  t0=$(date +%s.%N)
  "${VSNAP[@]}" restore "$IMAGE" --port "$PORT" $RESTORE_ARGS --detach --json > "$OUT/restore$n.json" 2> "$OUT/restore$n.err"; rc=$?
  echo "restore rc=$rc"; tail -8 "$OUT/restore$n.err"
  if [ $rc -ne 0 ]; then
    cat "$OUT/restore$n.json"; tail -60 "$WORK/control/$SHAPE".instances/r-*/engine.log
    tail -30 "$WORK/control/$SHAPE".instances/r-*/restore.log; exit 30
  fi
  "$PY" scripts/check_oracle.py "$IMAGE" "http://127.0.0.1:$PORT" > "$OUT/check$n.json"; crc=$?
  t1=$(date +%s.%N)
  echo "oracle over HTTP rc=$crc"
  "$PY" -c "import sys; print(f'restore+oracle over HTTP: {float(sys.argv[2]) - float(sys.argv[1]):.2f} s')" "$t0" "$t1"
  echo "$t0 $t1" > "$OUT/wall$n.txt"
  nvidia-smi --query-gpu=memory.used --format=csv,noheader > "$OUT/gpu-restored$n.txt"
  instance_dir=$("$PY" -c "import json,sys; print(json.load(open(sys.argv[1]))['instance_dir'])" "$OUT/restore$n.json")
  cp "$instance_dir/restore.log" "$OUT/restore$n.log" 2>/dev/null
  cp "$instance_dir/engine.log" "$OUT/engine-restore$n.log" 2>/dev/null
  grep -h "^vsnap: \(disconnected\|reconnected\)" "$OUT/engine-restore$n.log" | cut -c1-300
  "${VSNAP[@]}" stop "$IMAGE" --json > "$OUT/stop$n.json" 2>&1
done

log "CRIU's page reads in restore #1 (scripts/criu-restore-profile.py)"
"$PY" scripts/criu-restore-profile.py "$OUT/restore1.log" | tee "$OUT/criu-restore-profile.txt"

log "vsnap restore --standby, then vsnap activate"
"${VSNAP[@]}" restore "$IMAGE" --standby --detach --json > "$OUT/standby.json" 2> "$OUT/standby.err"; rc=$?
echo "standby rc=$rc"; tail -4 "$OUT/standby.err"
if [ $rc -eq 0 ]; then
  nvidia-smi --query-gpu=memory.used --format=csv,noheader > "$OUT/gpu-standby.txt"
  instance=$("$PY" -c "import json,sys; print(json.load(open(sys.argv[1]))['instance'])" "$OUT/standby.json")
  t0=$(date +%s.%N)
  "${VSNAP[@]}" activate "$instance" --port "$PORT" $RESTORE_ARGS --json > "$OUT/activate.json" 2> "$OUT/activate.err"; rc=$?
  echo "activate rc=$rc"; tail -6 "$OUT/activate.err"
  "$PY" scripts/check_oracle.py "$IMAGE" "http://127.0.0.1:$PORT" > "$OUT/check-activated.json"; echo "oracle over HTTP after activation rc=$?"
  t1=$(date +%s.%N)
  echo "$t0 $t1" > "$OUT/wall-activate.txt"
  cp "$WORK/control/$SHAPE".instances/"$instance"/engine.log "$OUT/engine-activated.log" 2>/dev/null
  "${VSNAP[@]}" stop "$instance" --json > "$OUT/stop-standby.json" 2>&1
fi
nvidia-smi --query-gpu=memory.used --format=csv,noheader > "$OUT/gpu-after.txt"
pgrep -f "vsnap.engine $WORK" > "$OUT/leftover-pids.txt" && echo "LEFTOVER PROCESSES" || echo "no process left"

"$PY" scripts/gpu_record.py "$OUT" "$IMAGE" "$SHAPE"
cp "$OUT/record.json" "$RESULTS/record-$TAG.json"
tar -C "$OUT" -czf "$RESULTS/$TAG-logs.tgz" .
