#!/usr/bin/env bash
# Install the offline vLLM bundle (made by vllm_bundle.sh) into SITE, from the bundle's
# directory. Every file may come in a different run, so each step does only what its
# files allow and says what is still missing:
#
#   bash install.sh SITE [--moe]
#
# Then: export PYTHONPATH=SITE:$PYTHONPATH VLLM_USE_FLASHINFER_SAMPLER=0
# (and SITE/stubs on the path too where Ray is not installed; install.sh puts the
# stand-in at SITE-stubs/ray). Idempotent: a second run redoes nothing.
set -euo pipefail
site=${1:?usage: install.sh SITE [--moe]}; moe=${2:-}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$site"
if [ ! -f "$site/.vllm-unpacked" ]; then
  ls "$here"/part-* >/dev/null 2>&1 || { echo "install.sh: no part-* here" >&2; exit 2; }
  cat "$here"/part-* | xz -d | tar -x -C "$site"
  touch "$site/.vllm-unpacked"
fi
fa3="$site/vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so"
[ -f "$fa3" ] || xz -d -c "$here/fa3.so.xz" > "$fa3"
if [ "$moe" = --moe ]; then
  [ -f "$site/vllm/_moe_C_stable_libtorch.abi3.so" ] || \
    xz -d -c "$here/moe.so.xz" > "$site/vllm/_moe_C_stable_libtorch.abi3.so"
fi
if [ ! -f "$site/.deps-installed" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --target "$site" "$here"/deps/*.whl
  touch "$site/.deps-installed"
fi
python3 -c "import ray" 2>/dev/null || { mkdir -p "$site-stubs"; cp -r "$here/stubs/ray" "$site-stubs/"; }
echo "installed into $site"
