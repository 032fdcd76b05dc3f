# Shared by the device scripts (sourced): the log folder, the time budget and
# `step NAME CAP_S COMMAND...`, which runs COMMAND into $out/NAME.txt (its
# tail on the console) for at most CAP_S seconds or what is left of the
# budget (TPCOMM_DEVICE_BUDGET_S, counted from the sourcing), whichever comes
# first, so that a step that hangs costs its cap and every step's log still
# comes back. The device returns at most 8 files: steps may share a log.
out="${OUT:-$PWD/out}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
# A worker that dies (a segfault) prints its Python stack instead of an EOF.
export PYTHONFAULTHANDLER=1
py="${PYTHON:-python3}"
deadline=$(( $(date +%s) + ${TPCOMM_DEVICE_BUDGET_S:-570} ))

step() {
  local name="$1" cap="$2"
  shift 2
  local left=$(( deadline - $(date +%s) ))
  (( left < cap )) && cap=$left
  if (( cap < 5 )); then
    echo "== $name: skipped, the budget is spent" | tee -a "$out/$name.txt"
    return
  fi
  local start rc
  start=$(date +%s)
  echo "== $*" >> "$out/$name.txt"
  timeout --kill-after=5 "$cap" "$@" >> "$out/$name.txt" 2>&1
  rc=$?
  local took=$(( $(date +%s) - start ))
  (( rc == 124 || rc == 137 )) && echo "stopped at its cap of ${cap}s" >> "$out/$name.txt"
  echo "== $name: rc=$rc in ${took}s" >> "$out/$name.txt"
  tail -n 12 "$out/$name.txt"
}

# Builds tpcomm with its C++ tests into build/gpu (GoogleTest carried as .gtest/).
build_tpcomm() {
  step build 240 "$py" -m pip install --no-build-isolation --no-deps -q \
    -C build-dir=build/gpu -C cmake.define.TPCOMM_BUILD_TESTS=ON \
    -C cmake.define.TPCOMM_GTEST_DIR="$PWD/.gtest" \
    -C cmake.define.Python_EXECUTABLE="$(command -v "$py")" .
}

# Starts an MPS control daemon (pipe and log folders under /tmp; no GPU
# setting changes), so that processes sharing the GPU run their kernels at
# once; stop_mps ends it.
start_mps() {
  export CUDA_MPS_PIPE_DIRECTORY="${CUDA_MPS_PIPE_DIRECTORY:-/tmp/tpcomm-mps-pipe}"
  export CUDA_MPS_LOG_DIRECTORY="${CUDA_MPS_LOG_DIRECTORY:-/tmp/tpcomm-mps-log}"
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d
}
stop_mps() { echo quit | nvidia-cuda-mps-control; }
