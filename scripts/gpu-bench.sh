#!/usr/bin/env bash
# `vsnap bench` on the GPU machine: SHAPE=tiny|8b, RUNS=3, COLD_RUNS=0 (0: RUNS-1), LAZY=1 (--lazy-pages). The record goes to
# $OUT/bench/ (a failed bench copies its logs there too); the engine's own notes and the output comparison are printed from it.
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
# into a file first: a bench stopped by the call's time limit still leaves its progress lines in $OUT
"$PY" -m vsnap bench "$SPEC" --runs "${RUNS:-3}" --cold-runs "${COLD_RUNS:-0}" ${LAZY:+--lazy-pages} --out "$OUT/bench" \
  > "$OUT/bench/bench.log" 2>&1
rc=$?
tail -40 "$OUT/bench/bench.log"
# The bench removed its own image and directories; what the engine logged is in the record.
"$PY" - "$OUT/bench" <<'PY'
import json, sys
from pathlib import Path
for path in sorted(Path(sys.argv[1]).glob("bench-*.json")):
    record = json.loads(path.read_text())
    for where, lines in (record.get("engine_notes") or {}).items():
        for line in lines:
            print(f"{where}: {line[:300]}")
    for key, c in (record.get("outputs") or {}).items():
        if not isinstance(c, dict):
            continue
        print(f"outputs {key}: {c['mismatched_prompts']} of {c['prompts']} prompts differ, first at "
              f"{c['first_mismatch_position']}, largest logprob difference {c['max_logprob_diff']:.3g}")
PY
tar -C "$OUT/bench" -czf "$OUT/bench-$SHAPE.tgz" . 2>/dev/null
exit $rc
