#!/usr/bin/env bash
# gpu-folio-probe.sh - does the way a file was written change how fast its page cache reaches the GPU?
# Session 15's hypothesis (docs/benchmarks/NOTES.md): weights by reference loaded at half the rate
# of the image's weights file because the model's files had been pulled in 1 MiB pwrites, which
# leave the page cache in folios smaller than 2 MiB, which the kernel maps (and cuMemHostRegister
# pins) 4 KiB at a time. Two files of GIB each, the same bytes, one written as the pull wrote
# (1 MiB pwrites, two ranges side by side), one as it writes now (4 MiB writes); then
# scripts/weights-dma-bench.py on each (register, pieces, dma_into), and page-lock-probe if a C
# compiler is there. No vLLM, no carry. Env: GIB (8), RUNS (1), BENCH_S (80: each bench's timeout),
# DIR (/var/tmp/vsnap-folio), OUT.
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
GIB=${GIB:-8}
DIR=${DIR:-/var/tmp/vsnap-folio}
OUT=${OUT:-/tmp/vsnap-gpu-out}/folio
PY=${PY:-/opt/torch/.venv/bin/python3}
[ -x "$PY" ] || PY=python3
mkdir -p "$DIR" "$OUT" && chmod 700 "$DIR"
{ uname -r; for q in /sys/block/*/queue/read_ahead_kb; do echo "$q $(cat "$q")"; done
  cat /sys/kernel/mm/transparent_hugepage/enabled; df -T "$DIR" | tail -1; } > "$OUT/host.txt" 2>&1
cat "$OUT/host.txt"
"$PY" - "$DIR" "$GIB" <<'PY'
import os, sys, time
d, gib = sys.argv[1], float(sys.argv[2])
size = int(gib * (1 << 30)) // (8 << 20) * (8 << 20)
block = os.urandom(1 << 20)
for name, chunk, interleaved in (("pull-1m", 1 << 20, True), ("write-4m", 4 << 20, False)):
    path = os.path.join(d, name)
    buf = block * (chunk >> 20)
    t = time.monotonic()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.posix_fallocate(fd, 0, size)
    half = size // 2
    for k in range(half // chunk):
        if interleaved:
            os.pwrite(fd, buf, k * chunk); os.pwrite(fd, buf, half + k * chunk)
        else:
            os.pwrite(fd, buf, 2 * k * chunk); os.pwrite(fd, buf, (2 * k + 1) * chunk)
    os.close(fd)
    print(f"{name}: {size / 2**30:.1f} GiB written in {time.monotonic() - t:.1f} s", flush=True)
PY
if command -v cc > /dev/null; then
  cc -O2 -o "$DIR/page-lock-probe" "$REPO/scripts/page-lock-probe.c" && "$DIR/page-lock-probe" "$DIR/pull-1m" "$DIR/write-4m" | tee "$OUT/probe.txt"
else echo "no C compiler: page-lock-probe not run" | tee "$OUT/probe.txt"; fi
for name in pull-1m write-4m; do
  echo "== $name"
  timeout "${BENCH_S:-80}" "$PY" "$REPO/scripts/weights-dma-bench.py" "$DIR/$name" --gib "$GIB" --runs "${RUNS:-1}" \
    --json "$OUT/dma-$name.json" \
    > "$OUT/dma-$name.log" 2>&1; echo "rc $?"
  tail -12 "$OUT/dma-$name.log"
done
rm -rf "$DIR"
