#!/usr/bin/env bash
# make demo-builtin: capture the built-in CPU engine, restore it, ask the restored server for a completion
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
curl -sS --fail "http://127.0.0.1:$PORT/v1/completions" -H 'content-type: application/json' \
  -d '{"prompt": "The capital of France is", "max_tokens": 8, "logprobs": 1}' |
  "$PYTHON" -c 'import json, sys; c = json.load(sys.stdin)["choices"][0]
print("completion:", repr(c["text"]), " (random weights: bytes, not words)")
print("token ids: ", c["token_ids"])
print("logprobs:  ", [round(v, 4) for v in c["logprobs"]["token_logprobs"]])'
echo
echo "== every oracle prompt, over HTTP, against the oracle recorded before the checkpoint"
"$PYTHON" scripts/check_oracle.py "$IMAGE" "http://127.0.0.1:$PORT" --summary
echo
"$VSNAP" stop "$IMAGE"
trap - EXIT
