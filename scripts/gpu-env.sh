# Sourced by the GPU scripts: install the carried vLLM and CRIU on the GPU machine (idempotent)
# and set the environment they need. Needs REPO and PY set; the call must carry
# .carry/vllm-parts-00 and .carry/criu (see ../shared/device/README.md).
if [ ! -d /tmp/site/vllm ]; then
  cat "$REPO"/.carry/vllm-parts-*/part-* > /tmp/vb.tar.xz && mkdir -p /tmp/site &&
    "$PY" -c "import tarfile; tarfile.open('/tmp/vb.tar.xz', mode='r:xz').extractall('/tmp/site', filter='data')" || exit 10
fi
[ -x /opt/criu-bundle/bin/criu ] || tar xzf "$REPO/.carry/criu/criu-bundle.tar.gz" -C /opt || exit 11
export PYTHONPATH=/tmp/site:$REPO/src
export VSNAP_CRIU=/opt/criu-bundle/bin/criu
export VLLM_USE_FLASHINFER_SAMPLER=0  # flashinfer is not in the carried bundle
sysctl -qw kernel.io_uring_disabled=2  # CRIU cannot dump io_uring (vsnap's preflight checks it)
