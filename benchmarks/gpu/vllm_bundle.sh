#!/usr/bin/env bash
# Build an offline vLLM bundle for a GPU machine without network whose torch is 2.11
# (Python 3.12, x86-64, CUDA 13): vLLM 0.26.0, the newest release pinned to torch 2.11,
# trimmed of what asyncrefit's GPU tests and benchmark do not need, plus the packages
# that machine lacks, in files of at most 60 MiB. See README.md beside this script.
#
#   bash benchmarks/gpu/vllm_bundle.sh OUTDIR
#
# OUTDIR/part-NN        pieces of vllm.tar.xz (the package without flash-attention 2,
#                       the Rust tool, third-party headers and the MoE kernels)
# OUTDIR/fa3.so.xz      FlashAttention 3 (vLLM's model registry imports flash-attention)
# OUTDIR/moe.so.xz      optional: vLLM's MoE kernels (_moe_C), for MoE models
# OUTDIR/deps/*.whl     what vLLM needs that the machine lacks, and pytest-asyncio
# OUTDIR/stubs/ray/     a stand-in for Ray (vLLM 0.26's ipc_engine imports it at module
#                       level, in every worker); leave it out where Ray is installed
# OUTDIR/install.sh     unpacks all of it into a site directory (README.md says how)
set -euo pipefail
out=${1:?usage: vllm_bundle.sh OUTDIR}; mkdir -p "$out"; out=$(cd "$out" && pwd)
here=$(cd "$(dirname "$0")" && pwd)
VLLM=${VLLM:-vllm==0.26.0}
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
plats=(); for n in 17 24 26 27 28 31 34 35; do plats+=(--platform "manylinux_2_${n}_x86_64"); done
pip_dl() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${plats[@]}" --platform any -d "$1" "${@:2}"; }
# WHEELS: a directory to keep the downloaded vLLM wheel in between builds (optional).
whl=${WHEELS:-$work/whl}
rm -rf "$out"; mkdir -p "$out/deps" "$out/stubs/ray" "$whl" "$work/site"
ls "$whl/vllm-${VLLM#vllm==}-"*.whl >/dev/null 2>&1 || pip_dl "$whl" "$VLLM"
(cd "$work/site" && unzip -q "$whl/vllm-${VLLM#vllm==}-"*.whl)
cd "$work/site"
# Hopper attention: its own file (11 MB), decompressed in place by install.sh.
xz -T0 -6 -c vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so > "$out/fa3.so.xz"
# MoE kernels: optional, for MoE models only.
xz -T0 -6 -c vllm/_moe_C_stable_libtorch.abi3.so > "$out/moe.so.xz"
# Not needed on an H100/H200 with bf16 models: flash-attention 2 (FA3 serves Hopper),
# the Rust tool, Blackwell attention, DeepGEMM's headers and other Pythons' builds,
# FlashMLA (MLA models), QuTLASS (FP4).
rm -f vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so \
  vllm/vllm-rs vllm/_moe_C_stable_libtorch.abi3.so vllm/_flashmla_C.abi3.so vllm/_qutlass_C.abi3.so \
  vllm/third_party/deep_gemm/_C.cpython-31[0134]-*.so
rm -rf vllm/third_party/fmha_sm100 vllm/third_party/deep_gemm/include
tar -cf - . | xz -T0 -6 > "$work/vllm.tar.xz"
(cd "$out" && split -b 60m -d "$work/vllm.tar.xz" part-)
# What vLLM 0.26 needs that the GPU image (torch 2.11) lacks, resolved on 2026-12-05 and
# seen working there; pytest-asyncio runs asyncrefit's tests.
for p in \
  "annotated-types==0.8.0" "apache-tvm-ffi==0.1.15.post2" "astor==0.8.1" "blake3==1.0.11" \
  "cachetools==8.0.2" "cbor2==6.3.0" "compressed-tensors==0.17.0" "depyf==0.20.0" \
  "dill==0.4.1" "diskcache==5.6.3" "distro==1.9.0" "fastapi==0.136.3" \
  "gguf==0.19.0" "httpcore2==2.17.0" "httpx2==2.17.0" "ijson==3.6.0" \
  "interegular==0.3.3" "jiter==0.19.0" "jsonschema==4.26.0" "jsonschema-specifications==2025.9.1" \
  "kernels==0.19.1" "lark==1.2.2" "llguidance==1.7.6" "lm-format-enforcer==0.11.3" \
  "loguru==0.7.3" "mistral_common==1.13.1" "msgspec==0.23.0" "openai==2.54.0" \
  "openai-harmony==0.0.8" "outlines_core==0.2.14" "partial-json-parser==0.2.1.1.post7" \
  "prometheus-fastapi-instrumentator==8.1.0" "pybase64==1.5.1" "pycountry==26.2.16" \
  "pydantic==2.14.4" "pydantic_core==2.50.5" "pydantic-extra-types==2.11.1" \
  "python-json-logger==4.2.0" "pyzmq==27.3.0" "referencing==0.37.0" "rpds-py==2026.9.1" \
  "setproctitle==1.3.8" "sniffio==1.3.1" "starlette==1.10.0" "tomlkit==0.15.3" \
  "truststore==0.10.5" "typing-inspection==0.4.5" "watchfiles==1.3.0" "xgrammar==0.2.9" \
  "pytest-asyncio==1.5.0"; do
  pip_dl "$out/deps" "$p"
done
cat > "$out/stubs/ray/__init__.py" <<'PY'
"""Stand-in for Ray where it is not installed: vLLM 0.26's ipc_engine imports ray at
module level and only asks whether it is initialised."""


def is_initialized() -> bool:
    return False
PY
cp "$here/install.sh" "$out/install.sh"
ls -la "$out" >&2
du -sh "$out"/* >&2
