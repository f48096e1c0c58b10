#!/usr/bin/env bash
# The direct-write GPU runs on a lent device machine: the GPU tests of the direct and
# CUDA IPC paths, then benchmarks/direct_write_bench.py on the Llama-2-7B set for 1, 2
# and 4 consumers. No vLLM needed; carry .gpu-bundle/deps (pytest-asyncio for the image).
#
#   bash benchmarks/gpu/direct_run.sh [consumers...]      # default: 1 2 4
#
# Logs and results go to $OUT (the device tool's folder that comes back).
set -uo pipefail
out=${OUT:-/tmp/out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "import pytest_asyncio" 2>/dev/null || \
  python3 -m pip install -q --no-index --no-deps -t /tmp/site-direct .gpu-bundle/deps/pytest_asyncio-*.whl
export PYTHONPATH=$PWD/src:/tmp/site-direct
python3 -c "import anyio, torch, pytest_asyncio; print('anyio', anyio.__version__, 'torch', torch.__version__)" \
  | tee -a "$out/gpu.txt"
timeout 200 python3 -m pytest -m gpu -p no:cacheprovider -o addopts="" --timeout 150 -v \
  tests/test_direct.py tests/test_cuda_ipc.py -k "direct or two_gpu_workers" 2>&1 \
  | tee "$out/direct_tests.log" | grep -E "PASS|FAIL|SKIP|ERROR|passed|failed" | tail -15
consumers=${*:-1 2 4}
timeout 360 python3 benchmarks/direct_write_bench.py --device cuda --consumers $consumers \
  --repeats 5 --out "$out/direct_gpu.json" 2>&1 | tee "$out/direct_gpu.log" | tail -20
