#!/usr/bin/env bash
# Issue 26 item 5 on the GPU machine: `vsnap activate` SIGKILLed at each point of bringing a
# detached standby up (cuda restore, after cuda restore, recover, activation.json, serve); for each,
# the time until the standby's tree is gone and no process of it holds GPU memory, and what it held
# right after the kill (tests/gpu/test_activation_kill.py). Prints a short table last.
#
#   bash scripts/gpu-kill-points.sh      (right after `bash scripts/gpu-e2e.sh`, tiny, in the same
#                                         warm session: it uses that run's image; carry .carry/criu)
# About 5 x 15 s of device time.
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO"
RESULTS=${OUT:-/tmp/vsnap-gpu-out}
OUT=$RESULTS/kill-points
PY=${PY:-/opt/torch/.venv/bin/python3}
IMAGE=${IMAGE:-/tmp/vsnap-gpu/images/${SHAPE:-tiny}}
mkdir -p "$OUT"
. "$REPO/scripts/gpu-env.sh"
[ -f "$IMAGE/manifest.json" ] || { echo "gpu-kill-points: no image at $IMAGE: run scripts/gpu-e2e.sh first" >&2; exit 14; }
rm -f "$OUT/kill-points.jsonl"
# the tests run `vsnap` from beside their interpreter (tests/conftest.py); this machine's venv has none
VSNAP_BIN=$(dirname "$PY")/vsnap
[ -x "$VSNAP_BIN" ] || { printf '#!/bin/sh\nexec %s -m vsnap "$@"\n' "$PY" > "$VSNAP_BIN" && chmod 755 "$VSNAP_BIN"; }
nvidia-smi --query-gpu=memory.used --format=csv,noheader > "$OUT/gpu-before.txt"
VSNAP_TEST_IMAGE=$IMAGE VSNAP_KILL_POINTS_OUT=$OUT/kill-points.jsonl \
  "$PY" -m pytest -m gpu -s -q -p no:cacheprovider tests/gpu/test_activation_kill.py > "$OUT/pytest.log" 2>&1
rc=$?
nvidia-smi --query-gpu=memory.used --format=csv,noheader > "$OUT/gpu-after.txt"
tail -n 15 "$OUT/pytest.log"
echo "GPU memory used before: $(cat "$OUT/gpu-before.txt"), after: $(cat "$OUT/gpu-after.txt")"
"$PY" - "$OUT/kill-points.jsonl" <<'PY'
import json, sys
print(f"{'killed at':<20} {'held after kill MiB':>20} {'freed after s':>14} {'left':>6}")
for line in open(sys.argv[1]):
    r = json.loads(line)
    print(f"{r['point']:<20} {sum(r['held_mib_after_kill'].values()):>20} {r['freed_s']:>14} "
          f"{'none' if not r['processes_left'] and not r['gpu_held_left'] else 'LEFT':>6}")
PY
echo "pytest rc=$rc"
exit $rc
