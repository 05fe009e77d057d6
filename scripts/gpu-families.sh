#!/usr/bin/env bash
# The model families beyond dense bf16 on the GPU machine (and the dense tiny Llama beside them): FP8 (quantized at load, and stored in
# FP8 with per-tensor scales, and with per-channel scales in the compressed-tensors format that most published FP8
# checkpoints use), a Mixtral-shaped MoE, LoRA adapters given at boot, ngram speculative decoding. Random-weight
# models from scripts/make_test_model.py, one spec per family.
#
#   FAMILIES="dense fp8-online fp8-ckpt fp8-channel moe lora ngram" MODE=check|bench bash scripts/gpu-families.sh
#
# MODE=check: every family captured at once (a fixed KV cache each, so that they share the GPU),
#   then each restored, its oracle checked over HTTP and stopped; a table last.
# MODE=bench: `vsnap bench --runs ${RUNS:-2} --cold-runs 1 --no-standby` per family, one after the
#   other; the records go to $OUT/bench/.
# The call must carry .carry/vllm-parts-00 and .carry/criu (see ../shared/device/README.md); on vLLM 0.33
# (scripts/gpu-install-vllm033.sh first, same warm machine): VLLM_SITE=/tmp/site033 and only .carry/criu.
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO"
OUT=${OUT:-/tmp/vsnap-gpu-out}
PY=${PY:-/opt/torch/.venv/bin/python3}
MODE=${MODE:-check}
FAMILIES=${FAMILIES:-dense fp8-online fp8-ckpt fp8-channel moe lora ngram}
WORK=/tmp/vsnap-gpu
M=/tmp/models
mkdir -p "$OUT/families" "$WORK" && chmod 700 "$WORK"
log() { echo "[$(date +%H:%M:%S)] $*"; }
. "$REPO/scripts/gpu-env.sh"

# ~3 GB an image (docs/benchmarks/families-h200-2026-12-01.md), all captured at once. On a machine kept
# warm since gpu-e2e.sh, gpu-bench.sh or gpu-side-by-side.sh, their 8B models, images and vllm
# artifact (up to ~60 GB of the 64 GiB disk) would make the captures run out of disk halfway.
if [ "$(df -B1G --output=avail /tmp | tail -1 | tr -dc 0-9)" -lt $(( $(wc -w <<<"$FAMILIES") * 4 + 4 )) ]; then
  log "$(df -h --output=avail /tmp | tail -1 | tr -d ' ') free: removing the 8B scratch of the other GPU scripts"
  rm -rf $WORK/images/8b $WORK/images/bench-8b $M/8b-llama /tmp/vsnap-sbs/{model.ok,hf,images,vllm-snapshots}
fi
log "write the test models"
"$PY" scripts/make_test_model.py $M/tiny-llama --shape tiny >/dev/null || exit 12
"$PY" scripts/make_test_model.py $M/tiny-fp8 --shape tiny --fp8 >/dev/null || exit 12
"$PY" scripts/make_test_model.py $M/tiny-fp8-channel --shape tiny --fp8 channel >/dev/null || exit 12
"$PY" scripts/make_test_model.py $M/tiny-moe --shape tiny-moe >/dev/null || exit 12
"$PY" scripts/make_test_model.py $M/lora-a1 --adapter --seed 1 >/dev/null || exit 12
"$PY" scripts/make_test_model.py $M/lora-a2 --adapter --seed 2 >/dev/null || exit 12

spec() {  # FAMILY -> the spec's path
  local family=$1 model=$M/tiny-llama extra=""
  case $family in
    fp8-online) extra="  quantization: fp8" ;;
    fp8-ckpt) model=$M/tiny-fp8 ;;
    fp8-channel) model=$M/tiny-fp8-channel ;;
    moe) model=$M/tiny-moe ;;
    lora) extra=$'  enable_lora: true\n  max_lora_rank: 8\n  max_loras: 2\n  lora_modules:\n    - a1='$M/lora-a1$'\n    - a2='$M/lora-a2 ;;
    ngram) extra='  speculative_config: {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}' ;;
  esac
  local memory="  gpu_memory_utilization: 0.5"
  [ "$MODE" = check ] || [ -n "${PARALLEL:-}" ] && memory=$'  gpu_memory_utilization: 0.1\n  kv_cache_memory_bytes: 1073741824'
  cat > "$WORK/$family.yaml" <<YAML
name: $family
engine: vllm
model: $model
image: $WORK/images/$family
serve:
  max_model_len: 2048
$memory
$extra
snapshot:
  control_dir: $WORK/control/$family
  timeout_s: 900
oracle:
  max_tokens: 8
  top_k: 5
  tolerance: 0.001
YAML
  echo "$WORK/$family.yaml"
}

VSNAP=("$PY" -m vsnap)
declare -A RESULT
if [ "$MODE" = bench ]; then
  mkdir -p "$OUT/bench"
  for family in $FAMILIES; do  # PARALLEL=1: all at once (each with a fixed KV cache), timings then shared
    log "vsnap bench $family"
    s=$(spec "$family")
    ( "${VSNAP[@]}" bench "$s" --runs "${RUNS:-2}" --cold-runs 1 --no-standby --out "$OUT/bench" \
        > "$OUT/families/bench-$family.log" 2>&1; echo $? > "$OUT/families/bench-$family.rc" ) &
    [ -n "${PARALLEL:-}" ] && sleep 5 || wait
  done
  wait
  for family in $FAMILIES; do
    RESULT[$family]="bench rc=$(cat "$OUT/families/bench-$family.rc")"
    tail -3 "$OUT/families/bench-$family.log" | sed "s/^/$family: /"
  done
  "$PY" - "$OUT/bench" <<'PY'
import json, sys
from pathlib import Path
print("| record | restore to first token (median) | cold start (warm) | restored vs cold | cold vs cold |")
for path in sorted(Path(sys.argv[1]).glob("bench-*.json")):
    r = json.loads(path.read_text())
    o = r["outputs"]
    cell = lambda c: f"{c['mismatched_prompts']}/{c['prompts']} differ, max logprob diff {c['max_logprob_diff']:.2g}"
    print(f"| {path.stem} | {r['restore_to_first_token_s_median']:.2f} s | {r['cold_start_to_first_token_s_median']:.1f} s | "
          f"{cell(o['restored_vs_cold'])} | {cell(o['cold_vs_cold'])} |")
PY
else
  log "capture: $FAMILIES (at once)"
  for family in $FAMILIES; do
    s=$(spec "$family")
    "${VSNAP[@]}" validate "$s" > "$OUT/families/validate-$family.txt" 2>&1
    ( "${VSNAP[@]}" capture "$s" --force --json > "$OUT/families/capture-$family.json" \
        2> "$OUT/families/capture-$family.err"; echo $? > "$OUT/families/capture-$family.rc" ) &
    sleep 2
  done
  wait
  port=8100
  for family in $FAMILIES; do
    rc=$(cat "$OUT/families/capture-$family.rc")
    image=$WORK/images/$family
    if [ "$rc" != 0 ]; then
      RESULT[$family]="capture rc=$rc"
      cp "$WORK/control/$family".instances/capture-*/engine.log "$OUT/families/engine-capture-$family.log" 2>/dev/null
      continue
    fi
    cp "$image/logs/engine.log" "$OUT/families/engine-capture-$family.log"
    port=$((port + 1))
    log "restore $family"
    t0=$(date +%s.%N)
    "${VSNAP[@]}" restore "$image" --port $port --detach --json > "$OUT/families/restore-$family.json" \
      2> "$OUT/families/restore-$family.err"; rrc=$?
    "$PY" scripts/check_oracle.py "$image" "http://127.0.0.1:$port" > "$OUT/families/oracle-$family.json" 2>&1; orc=$?
    t1=$(date +%s.%N)
    instance_dir=$("$PY" -c "import json,sys; print(json.load(open(sys.argv[1])).get('instance_dir',''))" \
      "$OUT/families/restore-$family.json" 2>/dev/null)
    [ -n "$instance_dir" ] && cp "$instance_dir/engine.log" "$OUT/families/engine-restore-$family.log" 2>/dev/null
    "${VSNAP[@]}" stop "$image" > /dev/null 2>&1
    RESULT[$family]="capture ok, restore rc=$rrc, oracle over HTTP rc=$orc, $("$PY" -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.2f} s')" "$t0" "$t1")"
  done
fi
pgrep -f "vsnap.engine $WORK" > "$OUT/families/leftover-pids.txt" && echo "LEFTOVER PROCESSES" || echo "no process left"
for family in $FAMILIES; do
  grep -h "^vsnap: configuration\|^vsnap: weights file\|^vsnap: the weights\|^vsnap: could not" \
    "$OUT/families/engine-capture-$family.log" 2>/dev/null | cut -c1-400 | sed "s/^/$family: /"
  [ -f "$OUT/families/capture-$family.err" ] && grep -v "^\s*$" "$OUT/families/capture-$family.err" | tail -3 | sed "s/^/$family: /"
done
echo "| family | result |"
for family in $FAMILIES; do echo "| $family | ${RESULT[$family]:-?} |"; done
tar -C "$OUT" -czf "$OUT/families-$MODE.tgz" families $([ -d "$OUT/bench" ] && echo bench) 2>/dev/null  # one file: a call brings back only a few
