#!/usr/bin/env bash
# One step of the GPU runs on a lent device machine (see README.md): the bundle travels in
# three carries of at most 64 MiB, each step back to back while the machine stays warm.
#
#   bash benchmarks/gpu/device_run.sh part      # carry .gpu-bundle/part-00
#   bash benchmarks/gpu/device_run.sh install   # carry fa3.so.xz, deps, stubs, install.sh
#   bash benchmarks/gpu/device_run.sh moe       # carry moe.so.xz
#   bash benchmarks/gpu/device_run.sh bench     # no carry: the benchmark alone, after install
#   bash benchmarks/gpu/device_run.sh local     # no carry: local GPU workers' tests and bench
#   bash benchmarks/gpu/device_run.sh fp8       # no carry: the FP8 push against bf16 (7B set)
#   bash benchmarks/gpu/device_run.sh torch     # carry deps: local and fp8 on a bare machine
#
# local, fp8 and torch need no vLLM: on a machine where install did not run, they take
# pytest-asyncio from the carried .gpu-bundle/deps.
# TESTS (default "not moe") selects the GPU tests the install step runs (pytest -k).
#
# Logs and results go to $OUT (the device tool's folder that comes back).
set -uo pipefail
step=${1:?usage: device_run.sh part|install|moe|bench|local|fp8|torch}
out=${OUT:-/tmp/out}; mkdir -p "$out" /tmp/bundle
# spawn: the tests and the benchmark initialise CUDA before vLLM starts its processes.
export PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_WORKER_MULTIPROC_METHOD=spawn
# The bundle carries DeepGEMM's library but not the headers its JIT compiles: an FP8
# block-scaled engine picking DeepGEMM dies at its first forward (measured 2026-12-07:
# "Failed to open .../deep_gemm/impls/sm90_fp8_gemm_1d2d.cuh"). vLLM's other FP8 kernels
# serve it; the test's two engines (pushed, loaded from the checkpoint) use the same one.
export VLLM_USE_DEEP_GEMM=0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
case "$step" in
part)
  cp .gpu-bundle/part-* /tmp/bundle/ && ls -la /tmp/bundle
  exit ;;
install)
  cp -r .gpu-bundle/fa3.so.xz .gpu-bundle/deps .gpu-bundle/stubs .gpu-bundle/install.sh /tmp/bundle/
  bash /tmp/bundle/install.sh /tmp/site || exit 1 ;;
moe)
  cp .gpu-bundle/moe.so.xz /tmp/bundle/
  bash /tmp/bundle/install.sh /tmp/site --moe || exit 1 ;;
bench)
  [ -d /tmp/site ] || { echo "install first (the machine went cold)"; exit 1; } ;;
local|fp8|torch)
  if [ ! -d /tmp/site ]; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/site \
      .gpu-bundle/deps/pytest_asyncio-*.whl .gpu-bundle/deps/sniffio-*.whl || exit 1
  fi ;;
esac
export PYTHONPATH=$PWD/src:/tmp/site:/tmp/site-stubs
python3 -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)" | tee -a "$out/gpu.txt"
if [ "$step" = torch ]; then
  bash "$0" local; bash "$0" fp8
elif [ "$step" = fp8 ]; then
  timeout ${BENCH_TIMEOUT:-500} python3 benchmarks/fp8_bench.py --device cuda --repeats 5 \
    --out "$out/fp8_bench.json" 2>&1 | tee "$out/fp8_bench.log" | tail -12
elif [ "$step" = local ]; then
  timeout 200 python3 -m pytest -m gpu -p no:cacheprovider --timeout 150 -v \
    tests/test_direct.py tests/test_quantization.py 2>&1 | tee "$out/gpu_direct_tests.log" | grep -E "PASS|FAIL|SKIP|ERROR|passed|failed" | tail -20
  timeout ${BENCH_TIMEOUT:-360} python3 benchmarks/direct_write_bench.py --device cuda \
    --consumers 1 2 4 --repeats 5 --timeline 10 --out "$out/direct_write_bench.json" 2>&1 \
    | tee "$out/direct_write_bench.log" | tail -75
elif [ "$step" = install ]; then
  timeout 520 python3 -m pytest -m gpu -p no:cacheprovider --timeout 240 -v -s -k "${TESTS:-not moe}" \
    tests/test_vllm_gpu.py 2>&1 | tee "$out/gpu_tests.log" | grep -E "PASS|FAIL|SKIP|ERROR|push|free GPU|passed|failed" | tail -40
else
  if [ "$step" = moe ]; then
    timeout 200 python3 -m pytest -m gpu -p no:cacheprovider --timeout 180 -v -s -k moe \
      tests/test_vllm_gpu.py 2>&1 | tee "$out/gpu_moe.log" | grep -E "PASS|FAIL|SKIP|ERROR|passed|failed" | tail -20
  fi
  timeout ${BENCH_TIMEOUT:-380} python3 benchmarks/vllm_gpu_bench.py --repeats 5 --timeline 10 \
    --out "$out/vllm_gpu_bench.json" 2>&1 | tee "$out/vllm_gpu_bench.log" | tail -75
fi
