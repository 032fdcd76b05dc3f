#!/usr/bin/env bash
# Builds and tests tpcomm on a GPU machine that has torch 2.11.0+cu130, nvcc,
# cmake, ninja and pytest but no network and no GoogleTest: carry a copy of
# /usr/src/googletest as .gtest/ (ignored by git). Logs go to $OUT (or ./out).
set -uo pipefail
out="${OUT:-$PWD/out}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
py="${PYTHON:-python3}"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  "$py" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  nvcc --version | tail -2
} 2>&1 | tee "$out/env.txt"
start=$(date +%s)
"$py" -m pip install --no-build-isolation --no-deps -q \
  -C build-dir=build/gpu -C cmake.define.TPCOMM_BUILD_TESTS=ON \
  -C cmake.define.TPCOMM_GTEST_DIR="$PWD/.gtest" \
  -C cmake.define.Python_EXECUTABLE="$(command -v "$py")" . > "$out/build.txt" 2>&1
echo "build rc=$? in $(( $(date +%s) - start ))s" | tee -a "$out/build.txt"
ctest --test-dir build/gpu -j 8 2>&1 | tail -5 | tee "$out/ctest.txt"
"$py" -m pytest -q -rs tests/gpu 2>&1 | tee "$out/pytest_gpu.txt" | tail -15
"$py" -m pytest -q -rs tests/python "$@" 2>&1 | tee "$out/pytest_cpu.txt" | tail -15
# The fused allreduce + add + RMSNorm, 2 ranks sharing GPU 0 (custom kernel), against the three ops.
"$py" -m tpcomm.bench fused --device cuda --world-sizes 2 4 2>&1 | tee "$out/bench_fused.txt" | tail -25
