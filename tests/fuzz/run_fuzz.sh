#!/usr/bin/env bash
# Builds the libFuzzer target for the shared-memory decoder with clang
# (Debian's clang + libclang-rt dev package) and runs a bounded number of
# executions; any crash, leak, overrun or undefined behaviour fails the run.
# Usage: tests/fuzz/run_fuzz.sh [runs]   (default 100000)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
runs="${1:-100000}"
out="$root/build/fuzz"
mkdir -p "$out"

fuzzer_lib_present() { compgen -G "/usr/lib/llvm-*/lib/clang/*/lib/linux/libclang_rt.fuzzer-x86_64.a" > /dev/null; }
if ! command -v clang++ > /dev/null || ! fuzzer_lib_present; then
  if [[ "$(id -u)" == 0 ]] && command -v apt-get > /dev/null; then
    echo "[fuzz] installing clang and its fuzzer runtime (Debian)" >&2
    apt-get update -qq && apt-get install -y -qq clang libclang-rt-14-dev > /dev/null
  else
    echo "[fuzz] clang with libFuzzer missing: install Debian's clang and libclang-rt-14-dev" >&2
    exit 1
  fi
fi

clang++ -std=c++17 -O1 -g -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
  -I"$root" "$root/tests/fuzz/fuzz_ring_reader.cpp" "$root/message_queue/ring/ring.cpp" \
  "$root/message_queue/ring/segment.cpp" "$root/message_queue/region/futex.cpp" \
  "$root/message_queue/region/shared_region.cpp" \
  "$root/common/error.cpp" "$root/common/settings.cpp" \
  -o "$out/fuzz_ring_reader" -lrt

cd "$out"
if ./fuzz_ring_reader -runs="$runs" -max_len=1024 -seed=1 > fuzz.log 2>&1; then
  echo "[fuzz] $(tail -n 1 fuzz.log)" >&2
else
  tail -n 40 fuzz.log >&2
  echo "[fuzz] FAILED: see build/fuzz/fuzz.log and the crash-* reproducer" >&2
  exit 1
fi
