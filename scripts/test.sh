#!/usr/bin/env bash
# test.sh — the whole test suite on this machine, in order:
#   1. the C++ CPU suite (ctest, label "cpu") of build/;
#   2. the same suite, the seeded C ABI harness and the fuzz target's corpus and regression
#      inputs (label "fuzz") in the sanitizer build build-asan/ (ASan + UBSan,
#      -fno-sanitize-recover=all: any report ends its program with an error, and so fails this
#      script), built here (CPU only) when missing or stale;
#   3. the coverage-guided fuzzer of the C ABI (scripts/fuzz.sh: clang + libFuzzer, installed
#      from Debian when missing) for FORGE_FUZZER_SECONDS (default 120) from a seed that changes
#      per run; a crash fails this script and names its input;
#   4. the Python suite (pytest), then again with the Python pre-hook of fused weights only
#      (FORGE_CPP_PREHOOK=0: forge/_prehook.py's fallback where no compiler is found).
# GPU tests run only on a GPU machine (scripts/gpu_check.sh). Run scripts/setup.sh first
# (.ci/run does both).
set -euo pipefail
cd "$(dirname "$0")/.."
ctest --test-dir build -L cpu --output-on-failure -j "$(nproc)"

# NOTE: each program runs once rather than one process per test through ctest: ASan's start-up
# in 280 processes cost ~20 s of CPU. Int8Map.DirectFormsEqualTheDefinition is left out here:
# a walk over 10^8 floats through formats.h's pure functions (no buffers, no ABI), 25 s plain
# and several times that instrumented; step 1 runs it.
echo "test: building the sanitizer build build-asan/ (ASan + UBSan, CPU only; a minute or two)"
cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=Release -DFORGE_CUDA=OFF -DFORGE_SANITIZE=ON >/dev/null
cmake --build build-asan -j "$(nproc)"
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=0}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1}"
build-asan/tests/cpp/forge_cpu_tests --gtest_brief=1 \
  --gtest_filter=-Int8Map.DirectFormsEqualTheDefinition
build-asan/tests/cpp/forge_alloc_failure_tests --gtest_brief=1
ctest --test-dir build-asan -L fuzz --output-on-failure  # (its default budget; FORGE_FUZZ_* set another)

bash scripts/fuzz.sh

.venv/bin/python -m pytest tests/python -q
FORGE_CPP_PREHOOK=0 .venv/bin/python -m pytest tests/python -q
