#!/usr/bin/env bash
# The custom allreduce's speed on a GPU, every measurement of one run, with
# the kernel's correctness checks first (within TPCOMM_DEVICE_BUDGET_S,
# default 480 s). Carry .gtest/ (a copy of /usr/src/googletest) and .peer/
# (vLLM's custom_all_reduce.cuh and custom_collective_common.cuh in
# .peer/vllm/, from the vllm sdist's csrc/; .peer/build/ may hold the harness
# built here, which is used when its key matches). Logs under $OUT:
#
#   build.txt     GPU, toolkit, build, the kernels' emulation and host tests (ctest)
#   tests.txt     the push, one-barrier and kernel tests (streams), then under
#                 MPS the processes' tests (IPC, hardening, faults, fused)
#   car.txt       bench car, float32, N = 2, 4, 8, 16 B-16 MiB (TPCOMM_DEVICE_CAR_MIB):
#                 empty kernels, one flag round trip, the call eager / graph /
#                 zero-copy, vLLM's kernel beside it, up to 1 MiB the forced push,
#                 barrier one-shot and PDL beside the default, fused vs allreduce
#   with TPCOMM_DEVICE_FULL=1 also: block sweeps from 1 MiB (car.txt),
#   car_bf16.txt  the same in bfloat16 up to 1 MiB
#   car_scope.txt the system-scope flags (TPCOMM_CAR_FLAG_SCOPE=system) up to 1 MiB
#   mps.txt       under MPS: bench allreduce (processes through IPC; host time
#                 per call), bench fused
#   car.png       the plot of car.txt
#   probe.txt     the kernels' own durations against the replay time, with and
#                 without external event nodes (tests/gpu/probe_car_graph.py)
#                 (TPCOMM_DEVICE_FULL=1 only)
#   lscpu.txt     lscpu and numactl --hardware (or /sys's nodes)
#   cpu.txt       the 16 cores (TPCOMM_DEVICE_CPU=0: not run): placement and
#                 kernel-level tests, bench cpu --scaling at 2, 4 and 8 ranks
#   hosts.txt     bench cpu --hosts 4 (TPCOMM_DEVICE_HOSTS=0: not run; needs `ip`:
#                 carry .iproute/, this machine's /usr/sbin/ip and its libraries)
#
#   bash tests/gpu/device_speed.sh
set -uo pipefail
export TPCOMM_DEVICE_BUDGET_S="${TPCOMM_DEVICE_BUDGET_S:-480}"
source "$(dirname "$0")/device_lib.sh"
export TPCOMM_PEER_BUILD_DIR="$PWD/.peer/build"
peer=()
[[ -f .peer/vllm/custom_all_reduce.cuh ]] && peer=(--peer-vllm .peer/vllm)

{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  "$py" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  nvcc --version | tail -2
} > "$out/build.txt" 2>&1
build_tpcomm
step build 40 ctest --test-dir build/gpu -j 16 --output-on-failure \
  -R "KernelEmulation|FusedEmulation|Car|CustomSetup|Settings"
step tests 90 "$py" -m pytest -q -rs -p no:cacheprovider tests/gpu/test_car_push.py \
  tests/gpu/test_car_one_barrier.py tests/gpu/test_custom_allreduce.py -k "not processes"
# Up to TPCOMM_DEVICE_CAR_MIB (16 by default; 64 for the bandwidth goals
# from 4 MiB, with the block sweeps when TPCOMM_DEVICE_FULL=1).
sweep=()
[[ "${TPCOMM_DEVICE_FULL:-0}" == 1 ]] && sweep=(--blocks-sweep 8 16 24 32 48 64)
step car 150 "$py" -m tpcomm.bench car "${peer[@]}" --fused --png "$out/car.png" \
  --max-mib "${TPCOMM_DEVICE_CAR_MIB:-16}" "${sweep[@]}"
if [[ "${TPCOMM_DEVICE_FULL:-0}" == 1 ]]; then
  step car_bf16 45 "$py" -m tpcomm.bench car "${peer[@]}" --dtype bfloat16 --max-mib 1
  step car_scope 30 env TPCOMM_CAR_FLAG_SCOPE=system "$py" -m tpcomm.bench car --max-mib 1 \
    --world-sizes 2 8 --quick
fi
if start_mps >> "$out/mps.txt" 2>&1; then
  step tests 140 "$py" -m pytest -q -rs -p no:cacheprovider tests/gpu/test_faults_gpu.py \
    tests/gpu/test_fused_norm_gpu.py tests/gpu/test_car_hardening.py \
    tests/gpu/test_coordinator_cuda.py tests/gpu/test_cuda_routing.py \
    "tests/gpu/test_custom_allreduce.py::test_processes_sharing_the_gpu_through_ipc_and_graph_replays"
  step mps 60 "$py" -m tpcomm.bench allreduce --quick --max-mib 1
  step mps 30 "$py" -m tpcomm.bench fused --device cuda --world-sizes 2 --quick --rounds 2
  stop_mps
else
  echo "no MPS control daemon: the processes' figures are missing" >> "$out/mps.txt"
fi
[[ "${TPCOMM_DEVICE_FULL:-0}" == 1 ]] && step probe 40 "$py" tests/gpu/probe_car_graph.py "${peer[@]}"
# The 16 cores: groups across simulated hosts (issue 52's time goals, which
# 2 shared cores cannot show; root and iproute2 needed, else it says why).
if [[ "${TPCOMM_DEVICE_CPU:-1}" == 1 ]]; then
  { lscpu; echo; numactl --hardware 2>&1 || grep . /sys/devices/system/node/node*/cpulist; } \
    > "$out/lscpu.txt" 2>&1
  # Many cores and NUMA nodes (issue 53): the placement read back from /proc
  # and every reduction level, then the scaling against Gloo and the memory
  # bandwidth (2 ranks x 1-8 threads; 4 and 8 ranks x 1-2).
  step cpu 120 "$py" -m pytest -q -rs -p no:cacheprovider tests/python/collectives/test_cpu_shm.py \
    -k "node or kernel_level or pinned"
  step cpu 120 "$py" -m tpcomm.bench cpu --scaling --world-sizes 2 --thread-counts 1 2 4 8 \
    --quick --rounds 2
  step cpu 120 "$py" -m tpcomm.bench cpu --scaling --world-sizes 4 8 --thread-counts 1 2 \
    --quick --rounds 2
  # The workers' polling between a call's chunks, off: against the 8t column above.
  step cpu 60 env TPCOMM_CPU_SHM_WORKER_SPIN_US=0 "$py" -m tpcomm.bench cpu --scaling \
    --world-sizes 2 --thread-counts 8 --quick --rounds 2
fi
if [[ "${TPCOMM_DEVICE_HOSTS:-1}" == 1 ]]; then
  # The device image has no iproute2: carry .iproute/ (this machine's ip
  # binary and the libraries ldd names for it that the image lacks).
  [[ -x .iproute/ip ]] && export PATH="$PWD/.iproute:$PATH" \
    LD_LIBRARY_PATH="$PWD/.iproute${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  step hosts 120 "$py" -m tpcomm.bench cpu --hosts 4 --ranks-per-host 2 --max-mib 16 --rounds 2
fi
tail -n 40 "$out/car.txt"
