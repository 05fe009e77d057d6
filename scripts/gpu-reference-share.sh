#!/usr/bin/env bash
# Issue 28 item 1 on the GPU machine: the share of a model's loaded weights that weights by
# reference finds in its files, per checkpoint format, with vLLM's CUDA processing (per-tensor FP8
# requantizes fused shards; FP8 at load quantizes a bf16 checkpoint: both need CUDA kernels that the
# CPU build of vLLM lacks, so the CPU VM measured only per-channel FP8; its bf16 linear weights are
# repacked outside torch there). Models of the 8B and 70B shapes with 2 and 1 layers (every layer
# alike; scripts/reference_share.py extrapolates), made on the GPU; one vLLM load each (eager, a
# 64 MiB KV cache). No CRIU run; ~3 to 4 minutes.
#
#   bash scripts/gpu-reference-share.sh     # carry .carry/vllm-parts-00 and .carry/criu (gpu-env.sh)
#
# Env: OUT, CASES (default: all, "label:model:layers-of[:quantization]" each), M (/tmp/models).
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO"
OUT=${OUT:-/tmp/vsnap-gpu-out}/reference-share
PY=${PY:-/opt/torch/.venv/bin/python3}
M=${M:-/tmp/models}
mkdir -p "$OUT" "$M"
log() { echo "[$(date +%H:%M:%S)] $*"; }
. "$REPO/scripts/gpu-env.sh"

make_model() {  # name, then make_test_model.py's arguments
  local name=$1; shift
  [ -f "$M/$name/config.json" ] || "$PY" scripts/make_test_model.py "$M/$name" "$@" --device auto > /dev/null || return 1
}
make_model share-8b-2l-bf16 --shape 8b --layers 2 &&
  make_model share-8b-2l-fp8t --shape 8b --layers 2 --fp8 tensor &&
  make_model share-8b-2l-fp8c --shape 8b --layers 2 --fp8 channel &&
  make_model share-70b-1l-fp8c --shape 70b --layers 1 --fp8 channel &&
  make_model share-70b-1l-fp8t --shape 70b --layers 1 --fp8 tensor || { log "could not write the models"; exit 12; }

CASES=${CASES:-"8b-bf16:share-8b-2l-bf16:32 8b-fp8-at-load:share-8b-2l-bf16:32:fp8 8b-fp8-tensor:share-8b-2l-fp8t:32
8b-fp8-channel:share-8b-2l-fp8c:32 70b-fp8-channel:share-70b-1l-fp8c:80 70b-fp8-tensor:share-70b-1l-fp8t:80"}
for c in $CASES; do
  IFS=: read -r label model layers quant <<<"$c"
  log "$label"
  timeout 240 "$PY" scripts/reference_share.py "$M/$model" --layers-of "$layers" --label "$label" \
    ${quant:+--quantization "$quant"} --json "$OUT/$label.json" > "$OUT/$label.log" 2>&1
  echo "$label rc $?"
done
echo "== referenced share per format"
"$PY" scripts/reference_share.py --brief "$OUT"/*.json
