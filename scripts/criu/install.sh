#!/usr/bin/env bash
# Install CRIU >= 4.2 on Debian/Ubuntu, building it from Debian's source package.
#
# CRIU older than 4.2 fails on current kernels (3.17: "vdso: Unexpected rt vDSO area
# bounds" on >= 6.13; 4.1: cannot dump AF_INET sockets on >= 6.16), and Debian 12 ships
# 3.17, so the upstream tarball of Debian's criu 4.2.x source package is fetched through
# apt (checked against the Sources index) and built with plain make.
#
# Usage (as root):
#   scripts/criu/install.sh                 install to $PREFIX/bin/criu (default /usr/local)
#   scripts/criu/install.sh --bundle OUT    also write a relocatable bundle (criu, its
#                                           non-glibc libs, cuda_plugin.so) to OUT.tar.gz,
#                                           for hosts without apt (the GPU machine);
#                                           OUT.tar.gz.vsnap-patches names its patches
# Our own patches to CRIU (scripts/criu/patches/*.patch, applied in order) are part of the
# build: docs/benchmarks/NOTES.md says what each one is for and what it measured.
# Idempotent: does nothing when a criu >= 4.2 built with these patches is already installed at
# $PREFIX/bin/criu (unless --bundle asks for a bundle that is not there yet).
# Env: CRIU_DEB_VERSION (default 4.2.1-1, or "latest"), PREFIX, WORK (scratch dir).
set -euo pipefail

CRIU_DEB_VERSION=${CRIU_DEB_VERSION:-4.2.1-1}
PREFIX=${PREFIX:-/usr/local}
WORK=${WORK:-/var/tmp/vsnap-criu-build}
BUNDLE_OUT=""
if [ "${1:-}" = "--bundle" ]; then BUNDLE_OUT=${2:?--bundle needs an output path}; fi
export DEBIAN_FRONTEND=noninteractive

log() { echo "criu-install: $*" >&2; }
die() { log "error: $*"; exit 1; }

PATCH_DIR=$(cd "$(dirname "$0")" && pwd)/patches
PATCHES=$(ls "$PATCH_DIR"/*.patch 2>/dev/null | sort || true)
# what the build is made of: the patches' contents (a stamp beside the installed binary)
PATCH_SUM=$( { for p in $PATCHES; do sha256sum < "$p"; done; } | sha256sum | cut -c1-16)
STAMP="$PREFIX/lib/criu/vsnap-patches"

version_ok() {  # $1 = criu binary; true when it runs and reports >= 4.2
  local v
  v=$("$1" --version 2>/dev/null | awk '/^Version:/{print $2}') || return 1
  [ -n "$v" ] || return 1
  [ "$(printf '%s\n4.2\n' "$v" | sort -V | head -1)" = "4.2" ]
}

[ "$(id -u)" = 0 ] || die "run as root (apt-get and the install need it)"

if version_ok "$PREFIX/bin/criu" && [ "$(cat "$STAMP" 2>/dev/null)" = "$PATCH_SUM" ] &&
   { [ -z "$BUNDLE_OUT" ] || [ "$(cat "$BUNDLE_OUT.vsnap-patches" 2>/dev/null)" = "$PATCH_SUM" ]; }; then
  log "$("$PREFIX/bin/criu" --version | head -1) (patches $PATCH_SUM) already at $PREFIX/bin/criu"
  exit 0
fi

mkdir -p "$WORK"
cd "$WORK"

# 1. deb-src entries for sid/forky: source packages only, so nothing from a newer suite
#    can be installed by accident.
SRCLIST=/etc/apt/sources.list.d/vsnap-criu-deb-src.sources
if ! apt-cache showsrc criu 2>/dev/null | grep -q "^Version: 4\.[2-9]"; then
  MIRROR=$(awk '/^URIs:/{print $2; exit}' /etc/apt/sources.list.d/*.sources 2>/dev/null || true)
  [ -n "$MIRROR" ] || MIRROR=$(awk '$1=="deb"{print $2; exit}' /etc/apt/sources.list 2>/dev/null || true)
  [ -n "$MIRROR" ] || die "no Debian mirror configured in apt sources"
  printf 'Types: deb-src\nURIs: %s\nSuites: sid forky\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' \
    "$MIRROR" > "$SRCLIST"
fi
log "apt-get update"
apt-get update -qq

# 2. build and runtime dependencies, all from the host's own suite.
apt-get install -y -qq --no-install-recommends \
  build-essential pkg-config libprotobuf-c-dev protobuf-c-compiler libprotobuf-dev \
  protobuf-compiler libnl-3-dev libnet1-dev libcap-dev libbsd-dev uuid-dev libaio-dev \
  iproute2 patch patchelf xz-utils ca-certificates >/dev/null

# 3. the upstream tarball, checked against the Sources index.
if [ "$CRIU_DEB_VERSION" = latest ]; then
  CRIU_DEB_VERSION=$(apt-cache showsrc criu | awk '/^Version:/{print $2}' | sort -V | tail -1)
fi
UPVER=${CRIU_DEB_VERSION%-*}
TARBALL="criu_$UPVER.orig.tar.xz"
[ -f "$TARBALL" ] || apt-get source --download-only "criu=$CRIU_DEB_VERSION" >/dev/null 2>&1 || true
[ -f "$TARBALL" ] || die "could not download $TARBALL (is criu $CRIU_DEB_VERSION in Debian sid/forky?)"
WANT=$(apt-cache showsrc criu | awk -v f="$TARBALL" 'length($1) == 64 && $3 == f {print $1; exit}')
GOT=$(sha256sum "$TARBALL" | cut -d' ' -f1)
[ -n "$WANT" ] && [ "$WANT" = "$GOT" ] || die "sha256 of $TARBALL: want '$WANT', got '$GOT'"

# 4. build (gnutls and nftables left out: vsnap needs neither).
if ! [ -x "criu-$UPVER/criu/criu" ] || ! [ -f "criu-$UPVER/plugins/cuda/cuda_plugin.so" ] ||
   [ "$(cat "criu-$UPVER/.vsnap-patches" 2>/dev/null)" != "$PATCH_SUM" ]; then
  rm -rf "criu-$UPVER"
  tar xf "$TARBALL"
  for p in $PATCHES; do
    log "applying $(basename "$p")"
    patch -s -p1 -d "criu-$UPVER" < "$p" || die "patch $(basename "$p") does not apply to criu $UPVER"
  done
  cat > "$WORK/pkg-config-nonft" <<'EOS'
#!/bin/sh
for a in "$@"; do case "$a" in libnftables*) exit 1;; esac; done
exec pkg-config "$@"
EOS
  chmod +x "$WORK/pkg-config-nonft"
  log "building criu $UPVER"
  make -s -C "criu-$UPVER" -j"$(nproc)" NO_GNUTLS=1 PKG_CONFIG="$WORK/pkg-config-nonft" criu cuda_plugin >build.log 2>&1 \
    || { tail -30 build.log >&2; die "build failed; full log: $WORK/build.log"; }
  echo "$PATCH_SUM" > "criu-$UPVER/.vsnap-patches"
fi

# 5. install.
install -D -m 755 "criu-$UPVER/criu/criu" "$PREFIX/bin/criu"
install -D -m 755 "criu-$UPVER/plugins/cuda/cuda_plugin.so" "$PREFIX/lib/criu/cuda_plugin.so"
echo "$PATCH_SUM" > "$STAMP"
version_ok "$PREFIX/bin/criu" || die "installed $PREFIX/bin/criu does not report version >= 4.2"
log "installed $("$PREFIX/bin/criu" --version | head -1) at $PREFIX/bin/criu"

# 6. optional relocatable bundle.
if [ -n "$BUNDLE_OUT" ]; then
  B="$WORK/stage/criu-bundle"
  rm -rf "$WORK/stage"; mkdir -p "$B/bin" "$B/libexec" "$B/lib/criu"
  install -m 755 "criu-$UPVER/criu/criu" "$B/libexec/criu"
  strip --strip-unneeded "$B/libexec/criu"
  patchelf --set-rpath '$ORIGIN/../lib' "$B/libexec/criu"
  install -m 755 "criu-$UPVER/plugins/cuda/cuda_plugin.so" "$B/lib/criu/"
  ldd "criu-$UPVER/criu/criu" | awk '/=> \//{print $3}' | while read -r lib; do
    case "$(basename "$lib")" in
      libc.so*|libm.so*|libpthread.so*|libdl.so*|librt.so*|ld-linux*) continue;;
    esac
    cp -L "$lib" "$B/lib/$(basename "$lib")"
  done
  for l in "$B"/lib/*.so*; do chmod u+w "$l"; patchelf --set-rpath '$ORIGIN' "$l"; done
  cat > "$B/bin/criu" <<'EOS'
#!/bin/sh
# Relocatable CRIU: libraries come from the real binary's RUNPATH ($ORIGIN/../lib).
HERE=$(cd "$(dirname "$(readlink -f "$0")")/.." && pwd)
export CRIU_LIBS_DIR="${CRIU_LIBS_DIR:-$HERE/lib/criu}"
exec "$HERE/libexec/criu" "$@"
EOS
  chmod 755 "$B/bin/criu"
  { echo "criu $UPVER (Debian source criu $CRIU_DEB_VERSION, orig sha256 $GOT)"
    for p in $PATCHES; do echo "patch $(basename "$p") sha256 $(sha256sum < "$p" | cut -d' ' -f1)"; done
  } > "$B/BUILDINFO"
  mkdir -p "$(dirname "$BUNDLE_OUT")"
  tar -C "$WORK/stage" -czf "$BUNDLE_OUT" criu-bundle
  echo "$PATCH_SUM" > "$BUNDLE_OUT.vsnap-patches"
  log "bundle written to $BUNDLE_OUT"
fi
