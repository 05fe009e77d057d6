#!/usr/bin/env bash
# Two GPUs, one image: capture a vLLM server on GPU 0, restore it twice at the same time on GPU 0
# and GPU 1, check both against the oracle over HTTP, stop both. Run on nvidia-h200-x2.
#   bash scripts/gpu-multi.sh         (OUT=dir for the record and logs)
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO"
RESULTS=${OUT:-/tmp/vsnap-gpu-out}
OUT=$RESULTS/run-multi
PY=${PY:-/opt/torch/.venv/bin/python3}
WORK=/tmp/vsnap-gpu
mkdir -p "$OUT" "$WORK" && chmod 700 "$WORK"
log() { echo "[$(date +%H:%M:%S)] $*"; }

. "$REPO/scripts/gpu-env.sh"
nvidia-smi -L | tee "$OUT/gpus.txt"
MODEL=/tmp/models/tiny-llama
"$PY" scripts/make_test_model.py "$MODEL" --shape tiny || exit 12
IMAGE=$WORK/images/multi
SPEC=$WORK/multi.yaml
cat > "$SPEC" <<YAML
name: multi
engine: vllm
model: $MODEL
image: $IMAGE
serve:
  max_model_len: 2048
  gpu_memory_utilization: 0.4
snapshot:
  control_dir: $WORK/control/multi
oracle:
  tolerance: 0.001
YAML
VSNAP=("$PY" -m vsnap)
GPU0=$(nvidia-smi --query-gpu=uuid --format=csv,noheader -i 0)
log "capture on GPU 0 ($GPU0)"
CUDA_VISIBLE_DEVICES=$GPU0 "${VSNAP[@]}" capture "$SPEC" --force --json > "$OUT/capture.json" 2> "$OUT/capture.err"
rc=$?; echo "capture rc=$rc"; tail -8 "$OUT/capture.err"
[ $rc -eq 0 ] || { tail -40 "$WORK/control/multi".instances/capture-*/engine.log; exit 20; }

log "restore on GPU 0 and GPU 1 at the same time"
t0=$(date +%s.%N)
"${VSNAP[@]}" restore "$IMAGE" --gpu 0 --port 8021 --detach --json > "$OUT/restore-gpu0.json" 2> "$OUT/restore-gpu0.err" &
p0=$!
"${VSNAP[@]}" restore "$IMAGE" --gpu 1 --port 8022 --detach --json > "$OUT/restore-gpu1.json" 2> "$OUT/restore-gpu1.err" &
p1=$!
wait $p0; rc0=$?; wait $p1; rc1=$?
t1=$(date +%s.%N)
echo "restore rc gpu0=$rc0 gpu1=$rc1"; tail -n 9 "$OUT/restore-gpu0.err" "$OUT/restore-gpu1.err"
"$PY" -c "import sys; print(f'both restores (in parallel): {float(sys.argv[2]) - float(sys.argv[1]):.2f} s')" "$t0" "$t1" | tee "$OUT/parallel.txt"
"${VSNAP[@]}" ps | tee "$OUT/ps.txt"
nvidia-smi --query-gpu=index,memory.used --format=csv,noheader | tee "$OUT/gpu-mem-serving.txt"
ok=0
for g in 0 1; do
  port=$((8021 + g))
  "$PY" scripts/check_oracle.py "$IMAGE" "http://127.0.0.1:$port" > "$OUT/check-gpu$g.json"; c=$?
  echo "GPU $g oracle over HTTP rc=$c: $("$PY" -c "import json,sys; d=json.load(open(sys.argv[1])); print('ok' if d['ok'] else 'MISMATCH', d['max_abs_logprob_diff'])" "$OUT/check-gpu$g.json" 2>/dev/null)"
  [ $c -eq 0 ] || ok=1
done
for g in 0 1; do
  d=$("$PY" -c "import json,sys; print(json.load(open(sys.argv[1])).get('instance_dir',''))" "$OUT/restore-gpu$g.json" 2>/dev/null)
  [ -n "$d" ] && cp "$d/engine.log" "$OUT/engine-gpu$g.log" 2>/dev/null && cp "$d/restore.log" "$OUT/restore-gpu$g.log" 2>/dev/null
done
"${VSNAP[@]}" stop "$IMAGE" --json > "$OUT/stop.json" 2>&1; cat "$OUT/stop.json"
nvidia-smi --query-gpu=index,memory.used --format=csv,noheader | tee "$OUT/gpu-mem-after.txt"
"$PY" - "$OUT" "$IMAGE" <<'PY' | tee "$RESULTS/record-multi.json"
import datetime, json, sys
from pathlib import Path
from vsnap import read_manifest
out, image = Path(sys.argv[1]), Path(sys.argv[2])
m = read_manifest(image)
def load(name):
    try:
        return json.loads((out / name).read_text())
    except Exception:
        return {}
record = {"date": datetime.date.today().isoformat(), "command": "bash scripts/gpu-multi.sh (nvidia-h200-x2)",
          "model": "random-weight Llama, tiny shape", "captured_gpu": m.host.gpus[0] if m.host.gpus else None,
          "driver": m.host.driver, "vllm": m.host.vllm, "torch": m.host.torch, "criu": m.host.criu,
          "capture_phases": load("capture.json").get("timings"), "image_bytes": m.sizes.get("image_bytes"),
          "parallel_restores_wall": (out / "parallel.txt").read_text().strip() if (out / "parallel.txt").exists() else None,
          "instances": []}
for g in (0, 1):
    r, c = load(f"restore-gpu{g}.json"), load(f"check-gpu{g}.json")
    record["instances"].append({"gpu_index": g, "gpu": r.get("gpu"), "port": r.get("port"), "phases": r.get("timings"),
                                "total_s": r.get("total_s"), "oracle_ok": c.get("ok"),
                                "max_abs_logprob_diff": c.get("max_abs_logprob_diff")})
record["oracle_ok"] = all(i["oracle_ok"] for i in record["instances"])
print(json.dumps(record, indent=2))
PY
tar -C "$OUT" -czf "$RESULTS/multi-logs.tgz" .
exit $ok
