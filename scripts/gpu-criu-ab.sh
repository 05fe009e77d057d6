#!/usr/bin/env bash
# A/B of CRIU's THP fill (scripts/criu/patches/0001) on one image: restores alternate between
# the carried CRIU as built and the same CRIU with --no-thp-fill; each restore's phases and the
# page reads from its CRIU log (scripts/criu-restore-profile.py). Prints a table last.
#
#   IMAGE=/tmp/vsnap-gpu/images/tiny N=2 bash scripts/gpu-criu-ab.sh     (after scripts/gpu-env.sh)
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO"
PY=${PY:-/opt/torch/.venv/bin/python3}
OUT=${OUT:-/tmp/vsnap-gpu-out}/criu-ab
IMAGE=${IMAGE:?IMAGE=path of a captured image}
PORT=${PORT:-8011}
mkdir -p "$OUT"
. "$REPO/scripts/gpu-env.sh"
CRIU_AS_BUILT=$VSNAP_CRIU
printf '#!/bin/sh\nexec %s "$@" --no-thp-fill\n' "$CRIU_AS_BUILT" > "$OUT/criu-no-thp-fill" && chmod 755 "$OUT/criu-no-thp-fill"
rows=()
for n in $(seq 1 "${N:-2}"); do
  for variant in thp-fill no-thp-fill; do
    criu=$CRIU_AS_BUILT; [ $variant = no-thp-fill ] && criu=$OUT/criu-no-thp-fill
    tag=$variant-$n
    VSNAP_CRIU=$criu "$PY" -m vsnap restore "$IMAGE" --port "$PORT" --detach --json > "$OUT/$tag.json" 2> "$OUT/$tag.err" || { tail -5 "$OUT/$tag.err"; continue; }
    "$PY" scripts/check_oracle.py "$IMAGE" "http://127.0.0.1:$PORT" > "$OUT/$tag-oracle.json"; orc=$?
    dir=$("$PY" -c "import json,sys; print(json.load(open(sys.argv[1]))['instance_dir'])" "$OUT/$tag.json")
    cp "$dir/restore.log" "$OUT/$tag-restore.log"
    "$PY" -m vsnap stop "$IMAGE" --json > /dev/null 2>&1
    "$PY" scripts/criu-restore-profile.py "$OUT/$tag-restore.log" > "$OUT/$tag-profile.txt"
    rows+=("$("$PY" - "$OUT/$tag.json" "$OUT/$tag-restore.log" "$tag" "$orc" <<'PY'
import json, sys
sys.path.insert(0, "scripts")
from importlib import import_module
prof = import_module("criu-restore-profile").profile(open(sys.argv[2], errors="replace").read().splitlines())
r = json.load(open(sys.argv[1]))
ph = r.get("timings", {})
big = max(prof["tasks"], key=lambda t: t["bytes"])
gb = sum(t["bytes"] for t in prof["tasks"]) / 1e9
print(f"{sys.argv[3]:<16} criu {ph.get('criu restore', 0):.2f} s  cuda {ph.get('cuda restore', 0):.2f} s  pages {gb:.2f} GB  "
      f"largest task {big['bytes']/1e9:.2f} GB at {big['gb_per_s']} GB/s  THP {big['thp_advised_mib']} MiB  oracle rc={sys.argv[4]}")
PY
)")
  done
done
printf '%s\n' "${rows[@]}" | tee "$OUT/table.txt"
