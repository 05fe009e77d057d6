#!/usr/bin/env bash
# A fresh node's time to first completion on the GPU machine (issue 27 item 3): the image and its
# model pushed to a registry on loopback, both removed from this node, the page cache dropped,
# then `vsnap pull --model-dir` + `vsnap restore` + one completion, timed from one clock
# (scripts/fresh_node.py does the work; this wraps it for the device machine).
#
#   bash scripts/gpu-fresh-node.sh        (SHAPE=8b, PARTS=4,8, RUNS=1, OUT=dir for logs)
#
# Run it in the same warm session right after `SHAPE=8b bash scripts/gpu-e2e.sh` (it needs that
# run's carried vLLM in /tmp/site, its model in /tmp/models/$SHAPE-llama and its image in
# /tmp/vsnap-gpu/images/$SHAPE). The call carries .carry/criu and .carry/registry (make it with
# scripts/make-registry-carry.sh): ~14 MiB.
#
# Storage (64 GiB disk, 128 GiB RAM): the registry's storage is in /dev/shm (RAM: a registry on
# another host does not use this node's disk), about the image's bytes (CRIU pages compressed) plus
# the model's; the node's disk holds the model and the image once each, as before (they are
# removed before each pull and brought back by it). The registry's storage is removed at the end.
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO"
SHAPE=${SHAPE:-8b}
RESULTS=${OUT:-/tmp/vsnap-gpu-out}
OUT=$RESULTS/fresh-node-$SHAPE
PY=${PY:-/opt/torch/.venv/bin/python3}
IMAGE=${IMAGE:-/tmp/vsnap-gpu/images/$SHAPE}
REGISTRY_ROOT=${REGISTRY_ROOT:-/dev/shm/vsnap-registry}
mkdir -p "$OUT"
log() { echo "[$(date +%H:%M:%S)] $*"; }

. "$REPO/scripts/gpu-env.sh"
if [ ! -x /tmp/registry/docker-registry ]; then
  mkdir -p /tmp/registry && tar xzf "$REPO/.carry/registry/registry.tar.gz" -C /tmp/registry ||
    { echo "gpu-fresh-node: carry .carry/registry (scripts/make-registry-carry.sh)" >&2; exit 13; }
fi
export PYTHONPATH=$PYTHONPATH:/tmp/registry/site   # after vLLM's site: its versions win where both have one
"$PY" -c "import oras.provider, zstandard" || { echo "gpu-fresh-node: the registry extra does not import" >&2; exit 13; }
[ -f "$IMAGE/manifest.json" ] || { echo "gpu-fresh-node: no image at $IMAGE: run SHAPE=$SHAPE scripts/gpu-e2e.sh first" >&2; exit 14; }
"$PY" -m vsnap ps --json > "$OUT/ps-before.json" 2>&1
df -h /tmp /dev/shm > "$OUT/df-before.txt"
du -sh "$IMAGE" "$("$PY" -c "import json,sys; print(json.load(open(sys.argv[1]))['launch']['model'])" "$IMAGE/manifest.json")" \
  >> "$OUT/df-before.txt" 2>&1
cat "$OUT/df-before.txt"

log "push with the model, then pull + restore + first completion from an empty node (PARTS=${PARTS:-4,8})"
"$PY" scripts/fresh_node.py "$IMAGE" --registry-root "$REGISTRY_ROOT" --registry-bin /tmp/registry/docker-registry \
  --out "$OUT" --parts "${PARTS:-4,8}" --runs "${RUNS:-1}" --i-may-delete-the-model > "$OUT/fresh-node.log" 2>&1
rc=$?
cp "$REGISTRY_ROOT/registry.log" "$OUT/" 2>/dev/null
du -sh "$REGISTRY_ROOT/storage" 2>/dev/null
# the registry's storage may hold the only copy of the image and the model after a failed run: kept then
[ $rc -eq 0 ] && rm -rf "$REGISTRY_ROOT"
df -h /tmp /dev/shm > "$OUT/df-after.txt"
tail -n 30 "$OUT/fresh-node.log" | cut -c1-400
echo "fresh_node.py rc=$rc"
exit $rc
