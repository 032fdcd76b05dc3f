#!/usr/bin/env bash
# The project's two entry points on a fresh machine:
#
#   bash python/run.sh demo [demo args...]   the main job
#   bash python/run.sh test [pytest args...] every test: C++ (ctest), the decoder
#                                             fuzzer (100,000 runs), then Python (pytest)
#
# Each creates .venv/ at the repository root, installs torch 2.11.0 and the
# build tools into it, builds tpcomm (scikit-build-core over the CMake build,
# without build isolation, into the persistent build/py), and runs. A second
# call reinstalls nothing and rebuilds only what changed.
set -euo pipefail

mode="${1:-}"
shift || true
case "$mode" in
  demo | test) ;;
  *)
    echo "usage: bash python/run.sh demo|test [args...]" >&2
    exit 2
    ;;
esac

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="$root/.venv"
py="$venv/bin/python"
build_dir="$root/build/py"

# Pinned so that every machine builds against the same toolchain.
requirements=(
  "torch==2.11.0"
  "scikit-build-core==1.1.2"
  "cmake==4.4.4"
  "ninja==1.13.2"
  "numpy==2.4.6"
  "pytest==9.2.0"
  "pytest-timeout==2.4.0"
  "matplotlib==3.11.2"  # the benchmarks' plots
)

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
    log "creating .venv with $base"
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
    "$py" -m pip install --quiet --disable-pip-version-check "$@"
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

# The tools that make the simulated hosts of tests/python/test_hosts.py
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
ensure_build() {
  local build_tests="$1"
  local stamp="$venv/.tpcomm-build"
  local sources
  sources="$(find CMakeLists.txt pyproject.toml backend coordinator custom_allreduce \
    message_queue python tests/cpp tests/fuzz -type f \
    \( -name '*.cpp' -o -name '*.hpp' -o -name '*.cu' -o -name '*.cuh' -o -name '*.py' \
    -o -name '*.txt' -o -name '*.toml' -o -name '*.inl' \) -print0 | sort -z | xargs -0 sha1sum | sha1sum)"
  local wanted="$sources tests=$build_tests"
  if [[ -f "$stamp" && "$(cat "$stamp")" == "$wanted" ]] \
    && { [[ "$build_tests" == OFF ]] || [[ -x "$build_dir/tests/cpp/tpcomm_cpp_tests" ]]; }; then
    return
  fi
  log "building tpcomm (incremental in build/py)"
  PATH="$venv/bin:$PATH" "$py" -m pip install --quiet --disable-pip-version-check \
    --no-build-isolation --no-deps \
    -C build-dir="$build_dir" \
    -C cmake.define.TPCOMM_BUILD_TESTS="$build_tests" \
    -C cmake.define.Python_EXECUTABLE="$py" \
    "$root"
  echo "$wanted" > "$stamp"
}

ensure_venv
export PATH="$venv/bin:$PATH"

if [[ "$mode" == demo ]]; then
  ensure_build OFF
  exec "$py" -m tpcomm.demo "$@"
fi

ensure_googletest
ensure_namespace_tools
install_once "$venv/.tpcomm-test-requirements" "${test_requirements[@]}"  # the test clients
ensure_build ON
log "C++ tests (ctest)"
ctest --test-dir "$build_dir" --output-on-failure -j "$(nproc)"
log "fuzzing the shared-memory decoder (libFuzzer)"
bash "$root/tests/fuzz/run_fuzz.sh" 100000
log "Python tests (pytest)"
if [[ $# -gt 0 ]]; then
  exec "$py" -m pytest "$@"
fi
exec "$py" -m pytest -rs tests/python tests/gpu
