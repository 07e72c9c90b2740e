#!/usr/bin/env bash
# fuzz.sh — the coverage-guided fuzzer of the C ABI (tests/cpp/fuzz/fuzz_abi.cpp: every entry
# point, batches of several entries, corrupted buffer contents; the contract it checks is in
# its header):
#   1. installs clang and libFuzzer's runtime from Debian if missing (apt-get);
#   2. builds build-fuzz/ with clang: the library and the target under ASan + UBSan
#      (float-cast-overflow included, any report ends the run) and libFuzzer's coverage;
#   3. runs libFuzzer: first every input of the checked-in seed corpus (tests/cpp/fuzz/corpus)
#      and the regression inputs (tests/cpp/fuzz/regressions), then new ones for
#      FORGE_FUZZER_SECONDS (default 120) from the seed FORGE_FUZZER_SEED (default: the clock, so
#      each run explores other inputs; the seed is printed, and with the same corpus the run
#      repeats).
# Any crash, sanitizer report or contract violation fails the script, which prints the input's
# path: copy it into tests/cpp/fuzz/regressions/ (every sanitizer build replays that folder,
# ctest label "fuzz"), fix the library, and run this again. New inputs go to build-fuzz/corpus/
# (not checked in); `build-fuzz/tests/cpp/fuzz_abi -merge=1 tests/cpp/fuzz/corpus
# build-fuzz/corpus` adds those that reach new code to the seed corpus.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${FORGE_FUZZER_SECONDS:-120}
seed=${FORGE_FUZZER_SEED:-$(date +%s)}

packages=(clang libclang-rt-14-dev libomp-dev)
missing=()
for p in "${packages[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if ((${#missing[@]})); then
  echo "fuzz: installing Debian packages: ${missing[*]} (apt-get; a minute or two)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q
  apt-get install -y -q "${missing[@]}"
fi

echo "fuzz: building build-fuzz/ (clang, libFuzzer, ASan + UBSan; a minute or two)"
mkdir -p build-fuzz
# (the build's output goes to build-fuzz/build.log: clang's warnings about the rules' bitwise
# & on bools, which is deliberate, would fill the CI log; shown when the build fails)
if ! { cmake -S . -B build-fuzz -G Ninja -DCMAKE_BUILD_TYPE=Release -DFORGE_CUDA=OFF \
         -DFORGE_BUILD_BENCH=OFF -DCMAKE_CXX_COMPILER=clang++ -DFORGE_SANITIZE=ON -DFORGE_FUZZ=ON \
         -DCMAKE_CXX_FLAGS="-fsanitize=fuzzer-no-link,float-cast-overflow" &&
       cmake --build build-fuzz --target fuzz_abi -j "$(nproc)"; } >build-fuzz/build.log 2>&1; then
  tail -n 40 build-fuzz/build.log
  echo "fuzz: the build failed (build-fuzz/build.log)"
  exit 1
fi

mkdir -p build-fuzz/corpus build-fuzz/artifacts
rm -f build-fuzz/artifacts/*
echo "fuzz: replaying tests/cpp/fuzz/{corpus,regressions}, then fuzzing for ${seconds} s (seed ${seed})"
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1}:abort_on_error=0"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1}:halt_on_error=1"
status=0
build-fuzz/tests/cpp/fuzz_abi build-fuzz/corpus tests/cpp/fuzz/corpus tests/cpp/fuzz/regressions \
  -seed="$seed" -max_total_time="$seconds" -timeout=20 -rss_limit_mb=2048 \
  -artifact_prefix=build-fuzz/artifacts/ -print_final_stats=1 \
  >build-fuzz/fuzz.log 2>&1 || status=$?
grep -E "^#[0-9]+[[:space:]]+(INITED|DONE)|^stat::number_of_executed_units|^stat::new_units_added" build-fuzz/fuzz.log || true
if ((status != 0)); then
  tail -n 60 build-fuzz/fuzz.log
  for f in build-fuzz/artifacts/*; do
    [ -e "$f" ] || continue
    echo "fuzz: FAILED (seed ${seed}): the input is $PWD/$f"
    echo "fuzz: replay it with build-fuzz/tests/cpp/fuzz_abi $f; keep it with"
    echo "      cp $f tests/cpp/fuzz/regressions/$(basename "$f")"
  done
  echo "fuzz: FAILED (status ${status}; the whole log: build-fuzz/fuzz.log)"
  exit 1
fi
echo "fuzz: ${seconds} s without a failure (seed ${seed})"
