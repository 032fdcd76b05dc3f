#!/usr/bin/env bash
# On a one-GPU machine, runs the multi-process GPU benchmarks and tests with
# an MPS control daemon, so that the ranks' kernels run at once instead of in
# time slices (about 4.4 ms a call without it): the custom kernel's figures
# across processes, and its flag protocol under true concurrency. Run after
# tests/gpu/device_run.sh on the same warm machine (it reuses build/gpu), or
# alone (it builds). The daemon is stopped at the end; no GPU setting changes.
#
#   bash tests/gpu/device_mps.sh
set -uo pipefail
source "$(dirname "$0")/device_lib.sh"
"$py" -m pip install --no-build-isolation --no-deps -q -C build-dir=build/gpu \
  -C cmake.define.Python_EXECUTABLE="$(command -v "$py")" . > "$out/mps_build.txt" 2>&1 \
  || { tail -20 "$out/mps_build.txt"; exit 1; }
start_mps || { echo "no MPS control daemon on this machine"; exit 1; }
trap stop_mps EXIT
step mps_bench_allreduce 150 "$py" -m tpcomm.bench allreduce --quick --max-mib 64
step mps_bench_fused 60 "$py" -m tpcomm.bench fused --device cuda --world-sizes 2 --quick \
  --rounds 3
step mps_pytest 200 "$py" -m pytest -q -rs -p no:cacheprovider tests/gpu/test_faults_gpu.py \
  tests/gpu/test_car_hardening.py tests/gpu/test_coordinator_cuda.py \
  tests/gpu/test_fused_norm_gpu.py tests/gpu/test_cuda_routing.py \
  "tests/gpu/test_custom_allreduce.py::test_processes_sharing_the_gpu_through_ipc_and_graph_replays"
