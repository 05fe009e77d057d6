#!/usr/bin/env bash
# gpu-vllm033-smoke.sh - prove the vLLM 0.33.0 + torch 2.14.0 carry runs on the GPU box (issue 25).
# Run after scripts/gpu-install-vllm033.sh has installed /tmp/site033, in the same device call:
#   bash scripts/gpu-install-vllm033.sh 2>&1 | tee $OUT/install.log && bash scripts/gpu-vllm033-smoke.sh
# $OUT gets at most 8 files (the device tool's limit): install.log (the caller's), box.txt, ldd.txt,
# torch.txt, vllm-import.txt, server.log, completion.json, summary.txt.
# Steps (each logged under $OUT, a table printed last):
#   1. the box: driver, GPU, the box's nvidia-* wheels;  2. ldd -r of the carried torch libraries;
#   3. torch 2.14 on CUDA: is_available, a bf16 matmul (checked against fp32 on the CPU, timed),
#      NCCL all_reduce on one rank (the carried NCCL), torch.compile through inductor and triton 3.8,
#      cuDNN's version check;  4. import vllm 0.33;  5. (SERVER=1, default) a cold
#      `python3 -m vllm.entrypoints.openai.api_server` on a tiny random-weight Llama
#      (scripts/make_test_model.py --shape tiny) and one greedy completion.
# Env: SITE033 (/tmp/site033), PY, SERVER (1), SERVER_TIMEOUT (300 s), PORT (8033).
set -uo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SITE="${SITE033:-/tmp/site033}"
PY="${PY:-/opt/torch/.venv/bin/python3}"
[ -x "$PY" ] || PY=python3
OUT="${OUT:-/tmp/vllm033-out}"; mkdir -p "$OUT"
PORT="${PORT:-8033}"
SERVER_TIMEOUT="${SERVER_TIMEOUT:-300}"
now() { date +%s.%N; }
secs() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.1f", b - a }'; }
declare -a ROWS
row() { ROWS+=("$(printf '| %-34s | %-6s | %s |' "$1" "$2" "$3")"); }
[ -f "$SITE/.vsnap-installed" ] || { echo "smoke: $SITE is not installed (run scripts/gpu-install-vllm033.sh)" >&2; exit 20; }
row "install ($SITE)" ok "$(cat "$SITE/.vsnap-installed")"

# 1. the box
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; uname -r
  "$PY" --version; env -u PYTHONPATH "$PY" -m pip list 2>/dev/null | grep -iE '^(torch|triton|nvidia-|cuda-)' ; } > "$OUT/box.txt" 2>&1
row "box" info "$(head -1 "$OUT/box.txt")"

# 2. every undefined symbol of the carried torch libraries resolves (torch's RPATH + the links)
LDD_BAD=0
for so in "$SITE"/torch/lib/libtorch_cuda.so "$SITE"/torch/lib/libtorch_python.so "$SITE"/torch/_C.cpython-312-x86_64-linux-gnu.so \
          "$SITE"/torch/lib/libtorch_cuda_linalg.so "$SITE"/torch/lib/libtorch_nvshmem.so "$SITE"/nvidia/nccl/lib/libnccl.so.2; do
  echo "== $so"; ldd -r "$so" 2>&1
done > "$OUT/ldd.txt"
# (Py* symbols come from the interpreter and C++ ones (_ZN...) from torch's own libraries loaded
# before: ldd -r of one library alone lists them; what matters is C API of CUDA/NCCL/cuDNN/...)
LDD_BAD=$(grep -E "not found|undefined symbol" "$OUT/ldd.txt" | grep -vcE "undefined symbol: (_?Py|_ZN)")
row "ldd -r torch/nccl libraries" "$([ "$LDD_BAD" = 0 ] && echo ok || echo FAIL)" "$LDD_BAD unresolved (ldd.txt); $(grep -m1 -o 'libnccl.so.2 => [^ ]*' "$OUT/ldd.txt")"

# 3. torch on CUDA
cat > /tmp/vllm033-torch.py <<'PYT'
import os, sys, time, json
t0 = time.time()
import torch
res = {"import_s": round(time.time() - t0, 2), "torch": torch.__version__, "cuda": torch.version.cuda}
res["available"] = torch.cuda.is_available()
res["device"] = torch.cuda.get_device_name(0)
res["capability"] = torch.cuda.get_device_capability(0)
res["driver_api"] = torch._C._cuda_getDriverVersion() if hasattr(torch._C, "_cuda_getDriverVersion") else None
x = torch.randn(512, 512, device="cuda")
err = (x @ x).cpu().sub(x.cpu() @ x.cpu()).abs().max().item()
res["fp32_matmul_maxerr"] = err
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16); b = torch.randn_like(a)
for _ in range(3): a @ b
torch.cuda.synchronize(); t = time.time()
for _ in range(10): a @ b
torch.cuda.synchronize(); dt = (time.time() - t) / 10
res["bf16_8192_tflops"] = round(2 * 8192**3 / dt / 1e12, 1)
res["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
import torch.distributed as dist
dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29533", rank=0, world_size=1, device_id=torch.device("cuda", 0))
y = torch.ones(1 << 20, device="cuda"); dist.all_reduce(y); torch.cuda.synchronize()
res["nccl_allreduce_ok"] = bool(y.eq(1).all().item())
dist.destroy_process_group()
import triton
res["triton"] = triton.__version__
t = time.time()
f = torch.compile(lambda v: torch.sin(v) * 2 + torch.cos(v).relu())
v = torch.randn(1 << 16, device="cuda")
res["compile_ok"] = bool(torch.allclose(f(v), torch.sin(v) * 2 + torch.cos(v).relu(), atol=1e-5))
res["compile_s"] = round(time.time() - t, 1)
try:
    res["cudnn"] = torch.backends.cudnn.version()
except Exception as e:  # the box's cuDNN 9.19 is older than the 9.24 torch 2.14 was built with
    res["cudnn"] = "refused: " + str(e).split(".")[0]
print(json.dumps(res))
PYT
T=$(now)
PYTHONPATH="$SITE" timeout 300 "$PY" /tmp/vllm033-torch.py > "$OUT/torch.txt" 2>&1; RC=$?
TJSON=$(grep '^{' "$OUT/torch.txt" | tail -1)
row "torch 2.14 on CUDA" "$([ $RC = 0 ] && echo ok || echo FAIL)" "${TJSON:-rc $RC, see torch.txt} ($(secs "$T" "$(now)") s)"

# 4. vllm import
T=$(now)
PYTHONPATH="$SITE" timeout 300 "$PY" -c "
import time; t = time.time(); import vllm, vllm.entrypoints.openai.api_server, vllm.v1.engine.core
print('vllm', vllm.__version__, 'import', round(time.time() - t, 1), 's')" > "$OUT/vllm-import.txt" 2>&1; RC=$?
row "import vllm" "$([ $RC = 0 ] && echo ok || echo FAIL)" "$(grep '^vllm ' "$OUT/vllm-import.txt" || tail -1 "$OUT/vllm-import.txt") ($(secs "$T" "$(now)") s)"

# 5. a cold API server on a tiny random-weight Llama, one greedy completion
if [ "${SERVER:-1}" = 1 ]; then
  MODEL=/tmp/vllm033-tiny
  [ -f "$MODEL/config.json" ] || env -u PYTHONPATH "$PY" "$REPO/scripts/make_test_model.py" "$MODEL" --shape tiny > /tmp/vllm033-model.txt 2>&1
  export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_WORKER_MULTIPROC_METHOD=spawn VLLM_HOST_IP=127.0.0.1 \
    VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 NCCL_IB_DISABLE=1 NCCL_SOCKET_IFNAME=lo GLOO_SOCKET_IFNAME=lo \
    TORCH_NCCL_ENABLE_MONITORING=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_CACHE_ROOT=/tmp/vllm033-cache
  CMD=("$PY" -m vllm.entrypoints.openai.api_server --model "$MODEL" --served-model-name tiny
       --max-model-len 2048 --gpu-memory-utilization 0.3 --port "$PORT")
  echo "+ PYTHONPATH=$SITE ${CMD[*]}" > "$OUT/server.log"
  T=$(now)
  PYTHONPATH="$SITE" setsid "${CMD[@]}" >> "$OUT/server.log" 2>&1 < /dev/null &
  SPID=$!
  UP=""; for ((i = 0; i < SERVER_TIMEOUT * 2; i++)); do
    kill -0 "$SPID" 2>/dev/null || break
    if "$PY" -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$PORT/health', timeout=1)" 2>/dev/null; then UP=1; break; fi
    sleep 0.5
  done
  THEALTH=$(now)
  if [ -n "$UP" ]; then
    "$PY" - "$PORT" > "$OUT/completion.json" 2>&1 <<'PYC'
import json, sys, urllib.request as u
req = u.Request(f"http://127.0.0.1:{sys.argv[1]}/v1/completions", headers={"Content-Type": "application/json"},
                data=json.dumps({"model": "tiny", "prompt": "The capital of France is", "max_tokens": 8,
                                 "temperature": 0, "logprobs": 1, "return_tokens_as_token_ids": True}).encode())
r = json.load(u.urlopen(req, timeout=60))
print(json.dumps(r))
PYC
    RC=$?
    TDONE=$(now)
    TOK=$("$PY" -c "import json,sys; r=json.load(open('$OUT/completion.json')); print(' '.join(r['choices'][0]['logprobs']['tokens']))" 2>/dev/null)
    row "cold api_server, tiny Llama" "$([ $RC = 0 ] && [ -n "$TOK" ] && echo ok || echo FAIL)" "health after $(secs "$T" "$THEALTH") s, first completion at $(secs "$T" "$TDONE") s: $TOK"
  else
    row "cold api_server, tiny Llama" FAIL "no /health within ${SERVER_TIMEOUT} s; last: $(grep -v '^\s*$' "$OUT/server.log" | tail -1 | cut -c1-200)"
  fi
  grep -E "Using .*backend|FLASH_ATTN|torch.compile takes|Graph capturing finished|init engine|Available KV cache|flashinfer|WARNING" "$OUT/server.log" | cut -c1-220 | head -20 > /tmp/vllm033-server-highlights.txt
  kill -TERM -- -"$SPID" 2>/dev/null; sleep 3; kill -KILL -- -"$SPID" 2>/dev/null
fi

{ echo
  echo "| step | result | detail |"
  echo "|---|---|---|"
  printf '%s\n' "${ROWS[@]}"
  echo; } | tee "$OUT/summary.txt"
cat /tmp/vllm033-server-highlights.txt 2>/dev/null
