#!/usr/bin/env bash
# What fills a vLLM image: capture the tiny model once and print each process's GPU memory before
# the CUDA checkpoint, its anonymous memory at the dump and its largest mappings, and what the
# worker reports after sleep. About 2.5 minutes on a fresh GPU machine (cold compile cache).
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO"
PY=${PY:-/opt/torch/.venv/bin/python3}
WORK=/tmp/vsnap-gpu
mkdir -p "$WORK" && chmod 700 "$WORK"
. "$REPO/scripts/gpu-env.sh"
"$PY" scripts/make_test_model.py /tmp/models/tiny-llama --shape tiny > /dev/null || exit 12
cat > "$WORK/probe.yaml" <<YAML
name: probe
engine: vllm
model: /tmp/models/tiny-llama
image: $WORK/images/probe
serve:
  max_model_len: 2048
  gpu_memory_utilization: 0.5
snapshot:
  control_dir: $WORK/control/probe
YAML
"$PY" -m vsnap capture "$WORK/probe.yaml" --force --json > "$WORK/probe.json" 2> "$WORK/probe.err" || { tail -20 "$WORK/probe.err"; exit 20; }
grep -h "^vsnap:" "$WORK/images/probe/logs/engine.log" | cut -c1-300
"$PY" - "$WORK/images/probe" <<'PY'
import sys
from vsnap import read_manifest
m = read_manifest(__import__("pathlib").Path(sys.argv[1]))
print("image", m.sizes, "cuda processes", m.cuda_processes)
for p in m.processes:
    print(p["pid"], "gpu", round(p.get("gpu_bytes", 0) / 1e6), "MB; anon", round(p["anonymous_bytes"] / 1e6), "MB;", p["command"][:60])
    for mp in p["largest_mappings"]:
        print("    ", round(mp["bytes"] / 1e6), "MB", mp["perms"], mp["name"][:70])
PY
