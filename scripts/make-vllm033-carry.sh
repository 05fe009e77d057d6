#!/usr/bin/env bash
# make-vllm033-carry.sh - vLLM 0.33.0 with torch 2.14.0 for the GPU box, in <= 60 MiB parts.
# Issue 25, step 1. The vLLM 0.26 carry (scripts/make-vllm-carry.sh, .carry/vllm-parts-*)
# is not touched: this one writes .carry/vllm033-wheels and .carry/vllm033-parts-NN/.
#   CARRY_DIR=$PWD/.carry bash scripts/make-vllm033-carry.sh
# then, on the GPU box, one call per part, back to back (scripts/gpu-install-vllm033.sh):
#   bash scripts/gpu-install-vllm033.sh        # carry .carry/vllm033-parts-NN in call NN
#
# Target box: Ubuntu 24.04, /opt/torch/.venv/bin/python3 (CPython 3.12), torch 2.11.0+cu130
# with its nvidia-* cu13 wheels (cuda-toolkit 13.0.2 set, cuDNN 9.19, cuSPARSELt 0.8.0,
# NCCL 2.28.9, NVSHMEM 3.4.5), cuda-bindings 13.3, triton 3.6, driver 580 (CUDA 13.0), sm_90.
#
# What torch 2.14.0 needs there (checked against its wheel's ELF files, see
# docs/benchmarks/vllm-0.33-carry-2026-12-04.md):
#  - CUDA 13.0.3 set: the same libraries as the box's 13.0.2 set but cuBLAS 13.1.1.3 for
#    13.1.0.3 (same sonames, no new symbols used): the box's are reused.
#  - cuDNN 9.24: torch 2.14 calls only cuDNN 9 API present in 9.19: the box's is reused
#    (torch.backends.cudnn refuses a runtime minor below the build's when cuDNN is first used,
#    i.e. convolutions/RNNs: none in vLLM's text models).
#  - cuSPARSELt 0.8.1: every symbol torch uses is in the box's 0.8.0: reused.
#  - NCCL 2.30.7: libtorch_cuda.so needs 11 symbols the box's 2.28.9 lacks (ncclCommGrow,
#    ncclCommSuspend/Resume, ncclCommMemStats, ncclSignal, ncclWinGetUserPtr, ...): CARRIED.
#  - NVSHMEM 3.4.5: same as the box's: reused.
#  - triton ~= 3.8.0 (the box has 3.6): CARRIED.  torchvision 0.29.0 (pins torch 2.14): CARRIED.
# The install script links the box's nvidia/* folders (all but nccl) beside the carried torch,
# so torch's RPATH ($ORIGIN/../../nvidia/<x>/lib) finds them.
#
# Made and run on 2026-12-04: 59 wheels (1,385 MB) -> 1,840 MB raw tar -> 302,934,040 bytes of xz
# (288.9 MiB) in 5 parts; on the H200: install 32.9 s, torch 2.14 CUDA/NCCL/compile ok, a cold
# vLLM 0.33 API server on a tiny Llama answered (docs/benchmarks/vllm-0.33-carry-2026-12-04.md).
#
# Steps: 1) pip-download the exact wheels (hash-pinned, cp312 manylinux x86_64) into
#        .carry/vllm033-wheels/;  2) unpack them into a staging site dir;  3) prune: drop what a
#        dense/FP8/MoE model on sm_90 never loads, zero non-sm_90 fatbin payloads
#        (scripts/fatbin-sm90.py) in torch, NCCL, vLLM and torchvision;  4) tar | xz, split into
#        <= PART_MIB MiB parts, one folder per part;  5) print the install recipe.
#
# Env knobs: PART_MIB=50; XZ_OPTS="-9 -T1" (one core: this VM is shared); PY=python3;
#            CARRY_DIR (default ./.carry); KEEP_STAGE=DIR keeps the pruned site dir (for an
#            import trace); KEEP_TORCH_INCLUDE=0 drops torch/include (C++ headers: only needed
#            to build C++ extensions or inductor's C++ backend; 41 MB unpacked); SKIP_XZ=1
#            stops after pruning; STRIP=0 keeps .symtab/.strtab/.debug_* in the shared objects
#            (default 1: strip --strip-unneeded, ~570 MB unpacked, see step 3).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CARRY="${CARRY_DIR:-$PWD/.carry}"
WHEELS="$CARRY/vllm033-wheels"
WORK="$(mktemp -d "${TMPDIR:-/var/tmp}/vllm033-carry.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
STAGE="$WORK/site"
PY="${PY:-python3}"
PART_MIB="${PART_MIB:-50}"  # 50: a call carries a part plus the working tree (~4 MB) well under 64 MiB
XZ_OPTS="${XZ_OPTS:--9 -T1}"
KEEP_TORCH_INCLUDE="${KEEP_TORCH_INCLUDE:-1}"
STRIP="${STRIP:-1}"
export PIP_DISABLE_PIP_VERSION_CHECK=1
mkdir -p "$WHEELS"

# ---------------------------------------------------------------------------
# 1. The wheel set: vllm 0.33.0's requirements resolved for cp312/manylinux x86_64, minus
#    what the box has at a version that works (transformers 5.17, tokenizers, safetensors,
#    numpy, aiohttp, pillow, protobuf, requests, psutil, cloudpickle, einops, opencv, numba,
#    cuda-bindings, the nvidia-* libraries but NCCL, ...), minus packages a dense sm_90
#    FlashAttention-3 path never imports (flashinfer, cutlass-dsl, quack, tilelang, humming,
#    tokenspeed-mla, instanttensor, fastsafetensors, mistral_common, mcp, anthropic,
#    opentelemetry, torchaudio, torchcodec, PyNvVideoCodec, lm-format-enforcer,
#    outlines-core, nvtx). Versus the 0.26 set: apache-tvm-ffi 0.1.11, xgrammar 0.2.8,
#    oss-harmony 0.0.11 (provides openai_harmony; replaces openai-harmony), orjson, and
#    torch 2.14.0, triton 3.8.0, torchvision 0.29.0, nvidia-nccl-cu13 2.30.7.
# ---------------------------------------------------------------------------
LOCK="$WHEELS/lock.txt"
cat > "$LOCK" <<'EOF'
annotated-types==0.8.0 --hash=sha256:f072f4d804ea359e4eaf198b1af7a8b0943881a87f31bb764f8bf219bb9419e0
apache-tvm-ffi==0.1.11 --hash=sha256:78aa1857b04a2ea718317041ab3f01288b3d496e6036eb1b99ebdc9da0fdaef5
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
jsonschema-specifications==2025.9.1 --hash=sha256:98802fee3a11ee76ecaca44429fda8a41bff98b00a0f2838151b113f210cc6fe
jsonschema==4.26.0 --hash=sha256:d489f15263b8d200f8387e64b4c3a75f06629559fb73deb8fdfb525f2dab50ce
lark==1.2.2 --hash=sha256:c2276486b02f0f1b90be155f2c8ba4a8e194d42775786db622faccd652d8e80c
llguidance==1.7.6 --hash=sha256:ceec951d29a74309984e3be0fe7f5f56c1362434cd937abd517b259a60908b1e
loguru==0.7.3 --hash=sha256:31a33c10c8e1e10422bfd431aeb5d351c7cf7fa671e3c4df004162264b28220c
model-hosting-container-standards==0.1.16 --hash=sha256:47f4f65713120bc3a69feb022981a38db9e557aedf88dbd72077f20588caa12b
msgspec==0.23.0 --hash=sha256:c08f294663135183bd633efd843645687285a445054a876c37506d4e9de7d80b
nvidia-nccl-cu13==2.30.7 --hash=sha256:cefa7fdb9710efd0f39c5f1be1d61ff6fc9a996c451265bd7fbdcf9455ed4b50
openai==3.57.0 --hash=sha256:f97bc74024c06ced8428b56c4a3594066709d3082779bf9d0b4b6092fbf587a8
orjson==3.13.0 --hash=sha256:bceadfd314bd238f584fc229a4bbaf0e573597e7a026dec5429fbf29fd66c641
oss-harmony==0.0.11 --hash=sha256:d877c6b526cdbdf55068bae8f05c60398e929c9e296c7f69a1d533339708be80
partial-json-parser==0.2.1.1.post7 --hash=sha256:145119e5eabcf80cbb13844a6b50a85c68bf99d376f8ed771e2a3c3b03e653ae
prometheus-fastapi-instrumentator==8.1.0 --hash=sha256:b9f40b2cff3f7891ca0610b3ae4fc6ec723fd326b04bb659819aaeb821a0fc7d
propcache==0.5.4 --hash=sha256:2814ecd8e818f487bee4b0f921bc4d1c176cc5fc71ac0f072d0fa67eda4ac14b
pybase64==1.5.1 --hash=sha256:c212d02fd072c5845d39b4699eb65efa827b79a5cf7fecc9f468f8cad2b8540f
pydantic-extra-types==2.11.1 --hash=sha256:1722ea2bddae5628ace25f2aa685b69978ef533123e5638cfbddb999e0100ec1
pydantic-settings==2.16.3 --hash=sha256:d1db16a2d34006323a1b42c0640898da58adfbad7ec30baaa9e2b18aafc08999
pydantic==2.14.4 --hash=sha256:653a2ad9f6d8858529c77c72717d0ea991d6c6837fe683246b2f4b2bbfc3fadc
pydantic_core==2.50.5 --hash=sha256:470bbc2495367f60d3ca849a8039e4c164701d10637e7743f4427d92651bdb6d
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
torch==2.14.0 --hash=sha256:fecffb58f51fd643d213acd68da21cc3fc19bea05a3bc64b4ee55128f47a4963
torchvision==0.29.0 --hash=sha256:0e631a2f8b24732672d35224d2574ff89a78d56bef5364ef6094a625fa5f1771
triton==3.8.0 --hash=sha256:e91ffa46d095b252248297292dd22bcbacd53a125a0c2eefbbbf74925a320bc3
truststore==0.10.5 --hash=sha256:9aaaedaefaf06d8b206278cf8b5012bc897f485a874503501e12d776df78951c
typing-inspection==0.4.5 --hash=sha256:bc210535442b39e1bf2805e0c7a17dfd6a4ace760c84c7f7d16245d23a6b1c39
uvicorn==0.54.0 --hash=sha256:505bdb0f318731d45f1f712071fc781a8981f6847a31c902c9f5e652d4f67faf
vllm==0.33.0 --hash=sha256:4b6bdec4ab269990bf70d45a3c1e94c3760a27064513760193b26d6f0da883aa
watchfiles==1.3.0 --hash=sha256:b5768b49e426fd5b550b012c866db347cdf15c398ef98dc557b6e6b72fa74cd1
websockets==17.4 --hash=sha256:9ae1429ee9e52b139167ed0169757806a27ed7307e942e8c62037a9184e9843b
xgrammar==0.2.8 --hash=sha256:4045b096735bb2523e0d874039a55994c1b390620d547c4a0d4f43b9a106177b
EOF

PLATS=(--platform manylinux1_x86_64 --platform manylinux2010_x86_64 --platform manylinux2014_x86_64)
for i in $(seq 17 39); do PLATS+=(--platform "manylinux_2_${i}_x86_64"); done
PLATS+=(--platform linux_x86_64)
PIPX=(--python-version 3.12 --implementation cp --only-binary=:all: "${PLATS[@]}")

echo "== [1/5] downloading $(grep -c . "$LOCK") hash-pinned wheels into $WHEELS"
"$PY" -m pip download -q --no-deps --require-hashes "${PIPX[@]}" -d "$WHEELS" -r "$LOCK" 2>&1 |
  grep -v "^WARNING: Location" || true
"$PY" - "$WHEELS" "$LOCK" <<'PYCLEAN'
# keep exactly the locked files: drop other versions and other builds of a locked version
import hashlib, os, re, sys
d, lock = sys.argv[1], sys.argv[2]
norm = lambda s: re.sub(r"[-_.]+", "_", s).lower()
want = {}
for l in open(lock):
    if "==" in l:
        want[l.split("--hash=sha256:")[1].strip()] = (norm(l.split("==")[0]), l.split("==")[1].split()[0])
have = set()
for f in sorted(os.listdir(d)):
    if f.endswith(".whl"):
        h = hashlib.sha256(open(os.path.join(d, f), "rb").read()).hexdigest()
        if h not in want:
            os.remove(os.path.join(d, f)); print("  removed stale", f)
        have.add(h)
if set(want) - have:
    sys.exit(f"missing wheels: {sorted(want[h] for h in set(want) - have)}")
PYCLEAN
WHEEL_BYTES=$(du -cb "$WHEELS"/*.whl | tail -1 | cut -f1)
echo "   wheels: $(ls "$WHEELS"/*.whl | wc -l) files, $((WHEEL_BYTES / 1000000)) MB"

echo "== [2/5] unpacking into the staging dir (pip --target, no deps, no bytecode)"
rm -rf "$STAGE" && mkdir -p "$STAGE"
"$PY" -m pip install -q --no-deps --no-compile --no-index "${PIPX[@]}" --target "$STAGE" "$WHEELS"/*.whl
rm -rf "$STAGE/bin"   # console scripts: use `python3 -m ...`
find "$STAGE" -name __pycache__ -type d -prune -exec rm -rf {} +
RAW_BEFORE=$(du -sb "$STAGE" | cut -f1)

echo "== [3/5] pruning for dense, FP8 and MoE models on sm_90 with sleep mode"
# Each entry: a path under the site dir and why it can go.
PRUNE=(
  # vLLM (same rules as the 0.26 carry, plus the kernels added since)
  "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so"   # FA2: sm80/89 or ALiBi only; sm90 picks FA3 (fa_utils); import in try/except
  "vllm/_qutlass_C.abi3.so"                    # FP4 quant (Blackwell)
  "vllm/_flashmla_C.abi3.so"                   # MLA (DeepSeek) only; guarded import in v1/attention/ops/flashmla.py
  "vllm/_flashmla_extension_C.abi3.so"         # ditto
  "vllm/_flashkda_C.abi3.so"                   # Kimi delta attention prefill, imported only by models/kimi_k3
  "vllm/_deepselect_C.abi3.so"                 # DeepSeek sparse indexer, probed with find_spec
  "vllm/vllm-rs"                               # Rust frontend binary (VLLM_USE_RUST_FRONTEND=1 only)
  "vllm/third_party/deep_gemm"                 # FP8 DeepGEMM + CUTLASS headers; has_deep_gemm() -> False
  "vllm/third_party/fmha_sm100"                # Blackwell sparse FMHA, lazily imported
  # triton 3.8
  "triton/backends/nvidia/lib/cupti"           # CUPTI for the proton profiler only (knobs.cupti_lib_dir)
  "triton/backends/nvidia/lib/cupti-blackwell" # ditto, Blackwell
  "triton/backends/nvidia/bin/ptxas-blackwell" # ptxas for arch >= 100 (compiler.py picks ptxas for sm_90)
  "triton/backends/nvidia/bin/nvdisasm"        # triton.tools.disasm only
  "triton/backends/nvidia/bin/cuobjdump"       # ditto
  "triton/_C/libproton.so"                     # proton profiler (triton.profiler), not imported otherwise
  "triton/instrumentation"                     # a test library
  "triton/plugins"                             # MLIR plugin examples and a test library
  # (triton/backends/amd stays: triton 3.8 finds its backends through entry points and fails without it)
  # torch 2.14
  "torch/bin/protoc" "torch/bin/protoc-3.13.0.0"
  "torch/share"                                # CMake config for C++ consumers
  "torch/lib/libshm_windows"
  # NCCL: keep lib/libnccl.so.2 only
  "nvidia/nccl/include"
)
for p in "${PRUNE[@]}"; do rm -rf "${STAGE:?}/$p"; done
find "$STAGE" -name '*.a' -delete              # static archives: link-time only
[ "$KEEP_TORCH_INCLUDE" = 1 ] || rm -rf "$STAGE/torch/include"
# zero the fatbin payloads a sm_90 GPU can never load (headers and offsets kept)
mapfile -t FATBIN_SO < <(cd "$STAGE" && ls torch/lib/libtorch_cuda.so torch/lib/libtorch_cuda_linalg.so \
  torch/lib/libtorch_nvshmem.so torch/lib/libc10_cuda.so nvidia/nccl/lib/libnccl.so.2 \
  vllm/_C_stable_libtorch.abi3.so vllm/_moe_C_stable_libtorch.abi3.so vllm/cumem_allocator.abi3.so \
  torchvision/_C.so 2>/dev/null)
(cd "$STAGE" && "$PY" "$HERE/fatbin-sm90.py" "${FATBIN_SO[@]}")
if [ "$STRIP" = 1 ]; then
  # .symtab/.strtab/.debug_* are not read at run time (the dynamic loader and dladdr use
  # .dynsym); in triton, torch and NCCL they are ~570 MB of mangled C++ names and DWARF
  # (libtriton.so 506 -> 192 MB, libtorch_cpu.so 446 -> 355, libtorch_cuda.so 503 -> 426).
  find "$STAGE" -type f \( -name '*.so' -o -name '*.so.*' \) -size +1M -print0 |
    xargs -0 -r strip --strip-unneeded
  echo "   stripped .symtab/.strtab/.debug_* from $(find "$STAGE" -type f \( -name '*.so' -o -name '*.so.*' \) -size +1M | wc -l) shared objects > 1 MB"
fi
RAW_AFTER=$(du -sb "$STAGE" | cut -f1)
echo "   site dir: $((RAW_BEFORE / 1000000)) MB -> $((RAW_AFTER / 1000000)) MB unpacked (zeroed bytes still counted)"
echo "   largest kept files:"
find "$STAGE" -type f -size +8M -printf '     %10s  %P\n' | sort -rn

# dependency check, runs on the GPU box after extraction
cat > "$STAGE/vsnap_carry_check.py" <<'PYCHK'
"""Check vllm 0.33.0's requirements against (the box's env + this site dir); import torch+vllm."""
import importlib.metadata as md, os, sys
from packaging.requirements import Requirement
here = os.path.dirname(os.path.abspath(__file__))
# Deliberate gaps (docs/benchmarks/vllm-0.33-carry-2026-12-04.md): optional kernels and
# front-ends a dense sm_90 model never imports, and pins that conflict with the box.
IGNORE = {"numba", "torchaudio", "torchcodec", "pynvvideocodec",
          "flashinfer-python", "tilelang", "nvidia-cudnn-frontend", "nvidia-cutlass-dsl",
          "quack-kernels", "tokenspeed-mla", "humming-kernels", "fastsafetensors",
          "instanttensor", "nvtx", "mistral-common", "mcp", "anthropic", "outlines-core",
          "lm-format-enforcer", "opentelemetry-sdk", "opentelemetry-api",
          "opentelemetry-exporter-otlp", "opentelemetry-semantic-conventions-ai"}
SOFT = {"setuptools"}  # a packaging-time pin
env = {"python_version": "%d.%d" % sys.version_info[:2], "platform_machine": "x86_64",
       "platform_system": "Linux", "sys_platform": "linux", "extra": ""}
missing = 0
for pkg in ("vllm", "torch"):
    for r in md.requires(pkg) or []:
        req = Requirement(r)
        if req.marker and not req.marker.evaluate(env):
            continue
        name = req.name.lower().replace("_", "-")
        try:
            v = md.version(req.name)
        except md.PackageNotFoundError:
            v = None
        if v is not None and (not req.specifier or req.specifier.contains(v, prereleases=True)):
            continue
        if name in IGNORE:
            tag = "ignored "
        elif v is None:
            tag, missing = "MISSING ", missing + 1
        else:
            tag = "note    " if name in SOFT else "VERSION "
        print(f"{tag}{pkg} needs {name}{req.specifier} (found {v})")
import torch, triton, vllm
print("vllm", vllm.__version__, "from", os.path.dirname(vllm.__file__), "| torch", torch.__version__,
      "cuda", torch.version.cuda, "| triton", triton.__version__)
sys.exit(1 if missing else 0)
PYCHK

if [ -n "${KEEP_STAGE:-}" ]; then rm -rf "$KEEP_STAGE" && cp -a "$STAGE" "$KEEP_STAGE" && echo "   staging dir kept in $KEEP_STAGE"; fi
[ "${SKIP_XZ:-0}" = 1 ] && { echo "SKIP_XZ=1: stopping before compression"; exit 0; }

echo "== [4/5] tar | xz $XZ_OPTS, split into <= ${PART_MIB} MiB parts"
BUNDLE="$WORK/bundle.tar.xz"
tar --sort=name --mtime='2026-01-01 00:00:00' --owner=0 --group=0 --numeric-owner \
    -C "$STAGE" -cf - . | tee >(wc -c > "$WORK/raw") | xz $XZ_OPTS -c > "$BUNDLE"
RAW=$(cat "$WORK/raw")
SHA=$(sha256sum "$BUNDLE" | cut -d' ' -f1)
TOTAL=$(stat -c %s "$BUNDLE")
rm -rf "$CARRY"/vllm033-parts-*
split -b $((PART_MIB * 1024 * 1024)) -d -a 2 "$BUNDLE" "$WORK/part-"
NPARTS=$(ls "$WORK"/part-* | wc -l)
for f in "$WORK"/part-*; do
  n="${f##*/part-}"
  mkdir -p "$CARRY/vllm033-parts-$n"
  mv "$f" "$CARRY/vllm033-parts-$n/part-$n"
  # each folder says how many parts make the bundle and the sha256 of the whole and of itself
  { echo "parts $NPARTS"; echo "bundle $SHA $TOTAL"; echo "part $n $(sha256sum "$CARRY/vllm033-parts-$n/part-$n" | cut -d' ' -f1)"; } \
    > "$CARRY/vllm033-parts-$n/INFO"
done
echo "   raw tar: $((RAW / 1000000)) MB -> xz: $TOTAL bytes ($((TOTAL / 1048576)) MiB) in $NPARTS part(s)"
ls -l "$CARRY"/vllm033-parts-*/part-* | awk '{printf "     %s  %s\n", $5, $9}'

echo "== [5/5] on the GPU box: one call per part, back to back (the box keeps /tmp ~30 s after a call):"
for ((i = 0; i < NPARTS; i++)); do
  printf '   call %d: carry [".carry/vllm033-parts-%02d"], command: bash scripts/gpu-install-vllm033.sh\n' "$i" "$i"
done
echo "   the call that brings the last missing part assembles and installs into /tmp/site033; then"
echo "   PYTHONPATH=/tmp/site033 python3 -c 'import torch, vllm'"
echo
echo "parts: $NPARTS   total: $TOTAL bytes ($((TOTAL / 1048576)) MiB)   sha256: $SHA"
