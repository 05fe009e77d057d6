#!/usr/bin/env bash
# gpu-install-vllm033.sh - bring the vLLM 0.33.0 + torch 2.14.0 carry onto the GPU box, part by part.
# Made by scripts/make-vllm033-carry.sh: .carry/vllm033-parts-NN/{part-NN,INFO}, each <= 60 MiB,
# so one device call carries one part (64 MiB a call, working tree included). The box keeps /tmp
# only while it stays warm (about 30 s after a call returns): make the calls back to back, each
#   carry: [".carry/vllm033-parts-NN"]   command: bash scripts/gpu-install-vllm033.sh [&& more work]
# Each call checks the parts it carries (sha256 in INFO) and stashes them in $STASH; the call that
# completes the set streams them through xz into $SITE (default /tmp/site033), links the box's own
# nvidia/* libraries beside the carried torch (all but NCCL, which the carry brings: torch's RPATH
# is $ORIGIN/../../nvidia/<lib>/lib), checks it, and writes $SITE/.vsnap-installed. Idempotent: once
# installed it does nothing. Exit status: 0 installed (now or before), 3 parts still missing,
# other: an error. Then:  PYTHONPATH=/tmp/site033 python3 -c 'import torch, vllm'
# Env: SITE033 (/tmp/site033), STASH033 (/tmp/vllm033-parts), PY (/opt/torch/.venv/bin/python3),
#      COMPILE=1 also byte-compiles the 9,250 .py files (compileall -j0, as gpu-env.sh does for the
#      0.26 site): the carry holds no bytecode, and where PYTHONDONTWRITEBYTECODE is set every
#      process compiles what it imports again. Default 0: the run of 2026-12-04 was made without it.
set -uo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SITE="${SITE033:-/tmp/site033}"
STASH="${STASH033:-/tmp/vllm033-parts}"
PY="${PY:-/opt/torch/.venv/bin/python3}"
[ -x "$PY" ] || PY=python3
now() { date +%s.%N; }
secs() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.1f", b - a }'; }
T0=$(now)

if [ -f "$SITE/.vsnap-installed" ]; then
  echo "vllm033: already installed in $SITE ($(cat "$SITE/.vsnap-installed"))"
  exit 0
fi

# 1. stash the parts this call carries
mkdir -p "$STASH"
for d in "$REPO"/.carry/vllm033-parts-*/; do
  [ -f "$d/INFO" ] || continue
  n=$(awk '$1 == "part" { print $2 }' "$d/INFO")
  want=$(awk '$1 == "part" { print $3 }' "$d/INFO")
  [ -f "$STASH/part-$n" ] && [ "$(cat "$STASH/part-$n.ok" 2>/dev/null)" = "$want" ] && continue
  got=$(sha256sum "$d/part-$n" | cut -d' ' -f1)
  if [ "$got" != "$want" ]; then echo "vllm033: part $n sha256 $got, INFO says $want" >&2; exit 12; fi
  cp "$d/part-$n" "$STASH/part-$n.tmp" && mv "$STASH/part-$n.tmp" "$STASH/part-$n" &&
    cp "$d/INFO" "$STASH/INFO" && echo "$want" > "$STASH/part-$n.ok" || exit 13
  echo "vllm033: stashed part $n ($(stat -c %s "$STASH/part-$n") bytes) in $(secs "$T0" "$(now)") s"
done
[ -f "$STASH/INFO" ] || { echo "vllm033: no part carried and none stashed (carry .carry/vllm033-parts-NN)" >&2; exit 14; }
NPARTS=$(awk '$1 == "parts" { print $2 }' "$STASH/INFO")
read -r BSHA BTOTAL < <(awk '$1 == "bundle" { print $2, $3 }' "$STASH/INFO")
HAVE=$(ls "$STASH"/part-?? 2>/dev/null | wc -l)
MISSING=$(for ((i = 0; i < NPARTS; i++)); do p=$(printf %02d "$i"); [ -f "$STASH/part-$p.ok" ] || printf '%s ' "$p"; done)
echo "vllm033: $HAVE of $NPARTS parts stashed in $STASH${MISSING:+ (missing: $MISSING)}"
[ -z "$MISSING" ] || exit 3

# 2. assemble and extract: one stream, checked against the whole bundle's sha256
T1=$(now)
rm -rf "$SITE" "$SITE.tmp" "$STASH/bundle.sha" && mkdir -p "$SITE.tmp"
if command -v xz >/dev/null; then
  cat "$STASH"/part-?? | tee >(sha256sum | cut -d' ' -f1 > "$STASH/bundle.sha") | xz -dc |
    tar -x --no-same-owner -C "$SITE.tmp" || { echo "vllm033: extraction failed" >&2; exit 15; }
else
  cat "$STASH"/part-?? | tee >(sha256sum | cut -d' ' -f1 > "$STASH/bundle.sha") |
    "$PY" -c "import sys, tarfile; tarfile.open(fileobj=sys.stdin.buffer, mode='r|xz').extractall('$SITE.tmp', filter='data')" ||
    { echo "vllm033: extraction failed" >&2; exit 15; }
fi
for _ in $(seq 50); do [ -s "$STASH/bundle.sha" ] && break; sleep 0.1; done  # the tee'd sha256sum
if [ "$(cat "$STASH/bundle.sha")" != "$BSHA" ]; then
  echo "vllm033: bundle sha256 $(cat "$STASH/bundle.sha") != $BSHA" >&2; exit 16
fi
T2=$(now)

# 3. link the box's nvidia/* libraries (CUDA 13.0 set, cuDNN, cuSPARSELt, NVSHMEM) beside the carried
#    torch, where its RPATH looks; the carried NCCL 2.30.7 stays (torch 2.14 needs its new symbols).
BOX_NV=$(env -u PYTHONPATH "$PY" -c "import nvidia, sys; print(next(p for p in nvidia.__path__ if 'site033' not in p))" 2>/dev/null)
if [ -n "$BOX_NV" ] && [ -d "$BOX_NV" ]; then
  for d in "$BOX_NV"/*/; do
    n=$(basename "$d")
    [ -e "$SITE.tmp/nvidia/$n" ] || ln -s "${d%/}" "$SITE.tmp/nvidia/$n"
  done
else
  echo "vllm033: warning: no nvidia/ package dir found for $PY; torch must find CUDA libraries elsewhere" >&2
fi
mv "$SITE.tmp" "$SITE"
if [ "${COMPILE:-0}" = 1 ]; then
  TC=$(now); "$PY" -m compileall -q -j0 "$SITE" > /dev/null 2>&1 || true
  echo "vllm033: byte-compiled $SITE in $(secs "$TC" "$(now)") s"
fi
T3=$(now)

# 4. check: requirements against box + carry (informational: VERSION lines name the box's CUDA
#    libraries reused on purpose), then the gate: torch, triton and vllm import (its last line)
PYTHONPATH="$SITE" "$PY" "$SITE/vsnap_carry_check.py" > "$STASH/check.txt" 2>&1; CHK=$?
grep -v "^W[0-9]\{4\} " "$STASH/check.txt" | grep -v "^ignored "
T4=$(now)
INFO="parts $NPARTS, $BTOTAL bytes; extract $(secs "$T1" "$T2") s, $([ "${COMPILE:-0}" = 1 ] && echo link+compile || echo link) $(secs "$T2" "$T3") s, check $(secs "$T3" "$T4") s, total $(secs "$T0" "$T4") s"
grep -q "^vllm 0.33.0 from $SITE/vllm | torch 2.14.0" "$STASH/check.txt" ||
  { echo "vllm033: import check failed (exit $CHK): $INFO" >&2; tail -5 "$STASH/check.txt" >&2; exit 17; }
[ "$CHK" = 0 ] || echo "vllm033: note: the requirement check exited $CHK (MISSING lines above); imports work"
echo "$INFO" > "$SITE/.vsnap-installed"
rm -f "$STASH"/part-?? "$STASH"/part-*.ok   # 2 GB of /tmp back; INFO stays for the record
echo "vllm033: installed in $SITE: $INFO"
echo "vllm033: use it with PYTHONPATH=$SITE $PY ..."
