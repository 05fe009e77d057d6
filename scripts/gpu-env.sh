# Sourced by the GPU scripts: install the carried vLLM and CRIU on the GPU machine (idempotent)
# and set the environment they need. Needs REPO and PY set; the call must carry
# .carry/vllm-parts-00 and .carry/criu (see ../shared/device/README.md).
# VLLM_SITE: where the carried vLLM is installed: /tmp/site (0.26, from .carry/vllm-parts-00, by
# this script) or /tmp/site033 (0.33 + torch 2.14, by scripts/gpu-install-vllm033.sh, part by part)
VLLM_SITE=${VLLM_SITE:-/tmp/site}
if [ "$VLLM_SITE" = /tmp/site ] && [ ! -d /tmp/site/vllm ]; then
  cat "$REPO"/.carry/vllm-parts-*/part-* > /tmp/vb.tar.xz && mkdir -p /tmp/site &&
    "$PY" -c "import tarfile; tarfile.open('/tmp/vb.tar.xz', mode='r:xz').extractall('/tmp/site', filter='data')" || exit 10
fi
[ -d "$VLLM_SITE/vllm" ] || { echo "gpu-env: no vLLM in $VLLM_SITE (scripts/gpu-install-vllm033.sh installs /tmp/site033)" >&2; exit 10; }
# The carry holds no bytecode: a vsnap command imports pydantic from it before its first phase, and
# where PYTHONDONTWRITEBYTECODE is set each command compiles it again (+890 M instructions, ~0.37 s
# on the CPU VM: docs/benchmarks/NOTES.md, session 5). Compiled once here, all of it as pip's install
# would (until session 10 only pydantic's packages were: typing_extensions.py, a single module, cost
# each 8B restore command 41 ms); a no-op when up to date.
"$PY" -m compileall -q -j0 "$VLLM_SITE" "$REPO/src/vsnap" >/dev/null 2>&1 || true
# the carried CRIU replaces an installed one built otherwise (its BUILDINFO names the patches).
# Build it with `scripts/criu/install.sh --bundle $PWD/.carry/criu/criu-bundle.tar.gz`:
# ../shared/device/build-criu-bundle.sh builds CRIU without our patches (0003: without it a
# restored process that used AMX dies of SIGILL), so a bundle lacking one of them is refused.
CRIU_WANT=$(tar xzf "$REPO/.carry/criu/criu-bundle.tar.gz" -O criu-bundle/BUILDINFO 2>/dev/null)
for patch in "$REPO"/scripts/criu/patches/*.patch; do
  grep -q "patch $(basename "$patch") sha256 $(sha256sum "$patch" | cut -d' ' -f1)" <<<"$CRIU_WANT" ||
    { echo "gpu-env: .carry/criu was not built with $(basename "$patch") as it is now: scripts/criu/install.sh --bundle" >&2; exit 11; }
done
if [ ! -x /opt/criu-bundle/bin/criu ] || [ "$(cat /opt/criu-bundle/BUILDINFO 2>/dev/null)" != "$CRIU_WANT" ]; then
  rm -rf /opt/criu-bundle && tar xzf "$REPO/.carry/criu/criu-bundle.tar.gz" -C /opt || exit 11
fi
export PYTHONPATH=$VLLM_SITE:$REPO/src
export VSNAP_CRIU=/opt/criu-bundle/bin/criu
export VLLM_USE_FLASHINFER_SAMPLER=0  # flashinfer is not in the carried bundle
sysctl -qw kernel.io_uring_disabled=2  # CRIU cannot dump io_uring (vsnap's preflight checks it)
