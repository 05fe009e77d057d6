#!/usr/bin/env bash
# make demo: capture the built-in CPU engine, restore it, ask the restored server for a completion
# and compare it with the oracle recorded at capture.
set -euo pipefail
VSNAP=${VSNAP:-vsnap}
PYTHON=${PYTHON:-$(dirname "$(command -v "$VSNAP")")/python}
SPEC=${SPEC:-examples/cpu.yaml}
IMAGE=${IMAGE:-/var/lib/vsnap/images/cpu-tiny}
PORT=${PORT:-8000}

echo "== vsnap capture $SPEC"
"$VSNAP" capture "$SPEC" --image "$IMAGE" --force
echo
echo "== vsnap restore $IMAGE --port $PORT --detach"
"$VSNAP" stop "$IMAGE" >/dev/null 2>&1 || true
"$VSNAP" restore "$IMAGE" --port "$PORT" --detach
trap '"$VSNAP" stop "$IMAGE" >/dev/null 2>&1 || true' EXIT
echo
echo "== POST /v1/completions to the restored server"
"$PYTHON" - "$IMAGE" "$PORT" <<'PY'
import json, sys, urllib.request
from vsnap import read_manifest
from pathlib import Path

oracle = read_manifest(Path(sys.argv[1])).oracle.samples[0]
body = {"prompt": oracle.prompt, "max_tokens": len(oracle.token_ids), "logprobs": 1}
request = urllib.request.Request(f"http://127.0.0.1:{sys.argv[2]}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
choice = json.load(urllib.request.urlopen(request, timeout=30))["choices"][0]
print(f"prompt:         {oracle.prompt!r}")
print(f"completion:     {choice['text']!r}  (random weights: bytes, not words)")
print(f"token ids:      {choice['token_ids']}")
print(f"logprobs:       {[round(v, 4) for v in choice['logprobs']['token_logprobs']]}")
expected = [top[str(t)] for t, top in zip(oracle.token_ids, oracle.logprobs)]
same = choice["token_ids"] == oracle.token_ids and choice["logprobs"]["token_logprobs"] == expected
print(f"equals the oracle captured before the checkpoint: {'yes' if same else 'NO'}")
sys.exit(0 if same else 1)
PY
echo
"$VSNAP" stop "$IMAGE"
trap - EXIT
