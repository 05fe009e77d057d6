#!/usr/bin/env bash
# What `vsnap push` and `vsnap pull` need on the GPU machine, which has no network and neither a
# registry nor vsnap's `registry` extra: Debian's docker-registry binary (this machine's, from `make
# system`; Go, linked only against the C library) and the wheels of oras and zstandard with their
# dependencies for CPython 3.12 on x86_64, unpacked (a pure unpack of a wheel is an install without
# entry points, which nothing here needs). One file, .carry/registry/registry.tar.gz (~15 MiB):
# carried beside .carry/criu by scripts/gpu-fresh-node.sh's call, unpacked into /tmp/registry.
#
#   bash scripts/make-registry-carry.sh        (from the repository root; needs the network)
set -euo pipefail
CARRY="${CARRY_DIR:-$PWD/.carry}/registry"
PY="${PY:-python3}"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/registry-carry.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
[ -x /usr/bin/docker-registry ] || { echo "no /usr/bin/docker-registry: run make system first" >&2; exit 1; }
mkdir -p "$CARRY" "$WORK/site"
# the versions vsnap's tests run with (make venv), so the GPU machine speaks to a registry as CI does
"$PY" -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  -d "$WORK/wheels" "oras==0.2.43" "zstandard==0.25.0" "requests==2.34.2" "urllib3==2.8.0" \
  "certifi==2026.10.19.post1" "charset-normalizer==3.5.3" "idna==3.20"
for wheel in "$WORK"/wheels/*.whl; do
  "$PY" -m zipfile -e "$wheel" "$WORK/site"
done
cp /usr/bin/docker-registry "$WORK/docker-registry"
tar czf "$CARRY/registry.tar.gz" -C "$WORK" site docker-registry
ls -l "$CARRY/registry.tar.gz"
sha256sum "$CARRY/registry.tar.gz"
