#!/usr/bin/env bash
# Builds and tests tpcomm on a GPU machine that has torch 2.11.0+cu130, nvcc,
# cmake, ninja and pytest but no network and no GoogleTest: carry a copy of
# /usr/src/googletest as .gtest/ (ignored by git). Logs go to $OUT (or ./out).
#
#   bash tests/gpu/device_run.sh [pytest args for the CPU suite...]
#
# Order: build, ctest, the kernel's tests, the GPU benchmarks (custom
# allreduce, dist.all_reduce per route), the other GPU test files, the fused
# allreduce + add + RMSNorm benchmark, then the CPU suite. The whole run fits in TPCOMM_DEVICE_BUDGET_S seconds (default 570,
# under the device's 600 s per command): each step is stopped at its own cap
# or at what is left of the budget, whichever comes first, so a step that
# hangs costs its cap and the logs of every step still come back.
set -uo pipefail
source "$(dirname "$0")/device_lib.sh"

{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  "$py" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  nvcc --version | tail -2
} 2>&1 | tee "$out/build.txt"  # the device returns at most 8 files: 7 logs and the plot
build_tpcomm
step ctest 60 ctest --test-dir build/gpu -j 8 --output-on-failure
# Each GPU test file has its own cap, so one that hangs costs only its cap;
# the kernel's own tests and the two benchmarks come first.
gpu_tests() {
  local file="$1" cap="$2"
  echo "== tests/gpu/$file" >> "$out/pytest_gpu.txt"
  step pytest_gpu "$cap" "$py" -m pytest -q -rs -p no:cacheprovider "tests/gpu/$file"
}
# What the last GPU session left unverified comes first.
gpu_tests test_faults_gpu.py 60
gpu_tests test_cuda_routing.py 100
gpu_tests test_custom_allreduce.py 90
step bench_car 45 "$py" -m tpcomm.bench car --png "$out/car.png"
step bench_allreduce 45 "$py" -m tpcomm.bench allreduce
# Its last test replays 4,297 captured calls of 2 processes time-sliced on
# one GPU (about 4.4 ms a call): give it room.
gpu_tests test_car_hardening.py 150
gpu_tests test_flight_recorder_gpu.py 45
gpu_tests test_cuda_nccl.py 40
gpu_tests test_coordinator_cuda.py 45
gpu_tests test_fused_norm_gpu.py 45
# 2 ranks sharing GPU 0 (custom kernel), against the three separate ops
# (time-slice bound on one GPU: it shows the path works, not its speed).
step bench_fused 40 "$py" -m tpcomm.bench fused --device cuda --world-sizes 2 --quick --rounds 1
# The CPU suite on this image (its gcc and Python differ from the CPU
# machine's); TPCOMM_DEVICE_CPU_SUITE=0 leaves it to the CPU machine.
if [[ "${TPCOMM_DEVICE_CPU_SUITE:-1}" != 0 ]]; then
  step pytest_cpu 300 "$py" -m pytest -q -rs tests/python "$@"
fi
