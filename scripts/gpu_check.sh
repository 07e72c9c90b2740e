#!/usr/bin/env bash
# gpu_check.sh — the one check of the CUDA backend on a GPU machine, in one call:
#   1. configure + build with CMake and Ninja into build-gpu/ (sm_90a by default;
#      FORGE_GPU_ARCHS="80;90a" builds both),
#   2. ctest -L gpu (the CUDA backend against the CPU backend; on Hopper the wgmma main loop),
#      its Wgrad bit-exact subset again on the portable sm80 path (FORGE_DEBUG_WGMMA=0), then
#      the benchmark (bench/wgrad_bench: fused step vs cuBLAS + unfused AdamW) on both paths,
#      and bench/torch_unfused.py (the same fused step vs cuBLAS + torch's fused AdamW),
#   3. compute-sanitizer memcheck and racecheck on a representative subset of the GPU tests,
#   4. ctest -L cpu (the CPU suite, against the library built with CUDA),
# writing results under $OUT (default ./out: summary.md, bench.md/json, bench-sm80.md,
# torch-unfused.md, and the logs packed in logs.tgz) and printing a summary table last.
# `bash scripts/gpu_check.sh trace` times a few layers with a per-CTA phase trace (see below).
# `bash scripts/gpu_check.sh ab` repeats the whole benchmark per setting, alternating, and
# prints the medians (see below).
# `bash scripts/gpu_check.sh soak` runs gate_proj's variants back to back with the card's SM
# clock, power and energy per call, then Nsight Compute on the fused kernel and cuBLAS's (below).
# `bash scripts/gpu_check.sh profile` instead builds only the benchmark and runs Nsight
# Compute (ncu, clocks left alone) on the fused step (4096 × 4096, T = 32 and 512, bf16 SR and
# int8 states, bf16 nearest, fp8 states, int4 states), the element-wise step and the unfused AdamW
# pass (with the shared-memory loads' wavefronts and bank conflicts), writing $OUT/ncu.txt.
# Every step has a time limit so the whole thing ends within FORGE_GPU_CHECK_BUDGET seconds
# (default 580, one 600 s device call). FORGE_GPU_CHECK_QUICK=1 runs only the build, ctest -L gpu and the default-path
# benchmark (for a call that also runs gpu_python.sh); FORGE_GPU_CHECK_TESTS=0 skips the tests
# too (a benchmark-only call); FORGE_GPU_CHECK_SWEEP="FORGE_DEBUG_GROUP_M=1 FORGE_DEBUG_PREFETCH_LEAD=512"
# adds one benchmark run per VAR=value setting (its totals printed, its tables in logs.tgz).
# FORGE_GPU_CHECK_CUDA_FLAGS="-DFORGE_SOME_EXPERIMENT=1" builds everything (library, tests,
# benchmark) with those CUDA flags: an experiment's whole check.
# GoogleTest comes from the system, or is built from build-deps/googletest when the machine
# has none (copy /usr/src/googletest there and carry build-deps).
# FORGE_GPU_PREBUILT=build-sm90 skips every build and uses that build tree instead, configured
# and built elsewhere for the same archs (e.g. here, on the CPU machine: cmake -B build-sm90
# -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90a, then ninja; then carry
# build-sm90): its recorded source and build paths are rewritten to this checkout's. It saves
# the device machine the ~150 s build.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
OUT=${OUT:-$ROOT/out}
mkdir -p "$OUT"
BUILD=$ROOT/build-gpu
ARCHS=${FORGE_GPU_ARCHS:-90a}
BUDGET=${FORGE_GPU_CHECK_BUDGET:-580}
QUICK=${FORGE_GPU_CHECK_QUICK:-0}
TESTS=${FORGE_GPU_CHECK_TESTS:-1}
SWEEP=${FORGE_GPU_CHECK_SWEEP:-}
JOBS=$(nproc)
START=$(date +%s)
PREBUILT=${FORGE_GPU_PREBUILT:-}
if [ -n "$PREBUILT" ]; then
  PREBUILT=$(cd "$PREBUILT" && pwd) || exit 1
  BUILD=$PREBUILT
  # The paths CMake recorded where the tree was built (ctest's test lists, the RPATHs aside).
  built_src=$(sed -n 's/^CMAKE_HOME_DIRECTORY:INTERNAL=//p' "$BUILD/CMakeCache.txt")
  built_dir=$(sed -n 's/^CMAKE_CACHEFILE_DIR:INTERNAL=//p' "$BUILD/CMakeCache.txt")
  if [ -z "$built_src" ] || [ -z "$built_dir" ]; then
    echo "FORGE_GPU_PREBUILT=$PREBUILT: no CMakeCache.txt with the recorded paths" >&2
    exit 1
  fi
  if [ "$built_dir" != "$BUILD" ]; then
    grep -rlF --include='*.cmake' --include=CMakeCache.txt -e "$built_dir" -e "$built_src" "$BUILD" |
      xargs -r sed -i "s#$built_dir#$BUILD#g; s#$built_src#$ROOT#g"
  fi
  export LD_LIBRARY_PATH=$BUILD${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi
SUMMARY=()

if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH="/usr/local/cuda/bin:$PATH"
fi

elapsed() { echo $(($(date +%s) - START)); }
log() { echo "[gpu_check $(elapsed)s] $*"; }
# Seconds a step may take: its own cap, or what is left of the budget minus a reserve for
# the steps after it.
limit() {
  local cap=$1 reserve=$2 left=$((BUDGET - $(elapsed) - $2))
  ((left < cap)) && cap=$left
  ((cap < 10)) && cap=10
  echo "$cap"
}
row() { SUMMARY+=("| $1 | $2 | $3 |"); }

if [ -n "$PREBUILT" ] && { [ "${1:-}" = trace ] || [ "${1:-}" = profile ]; }; then
  echo "FORGE_GPU_PREBUILT: the $1 mode builds its own benchmark; leave FORGE_GPU_PREBUILT unset" >&2
  exit 1
fi

if [ "${1:-}" = profile ]; then
  NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  log "profile: build the benchmark"
  cmake -S "$ROOT" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES="$ARCHS" \
    -DFORGE_BUILD_TESTS=OFF -DFORGE_BUILD_BENCH=ON >"$OUT/build.log" 2>&1 &&
    cmake --build "$BUILD" --target wgrad_bench -j "$JOBS" >>"$OUT/build.log" 2>&1 || {
    tail -30 "$OUT/build.log"
    exit 1
  }
  log "profile: ncu ($NCU)"
  # wgrad_bench --profile's 13 launches (its main() lists them): the fused step (whichever kernel
  # the environment selects: FORGE_DEBUG_PERSISTENT=1 profiles the persistent one) at T = 32 and
  # 512 with bf16 SR and int8 states, the element-wise step with both, the unfused AdamW pass,
  # the fused step with nearest-rounded bf16 W and states at T = 32 and 512, with fp8 states
  # (three), and with int4 states beside the SR weight at T = 512.
  timeout "${FORGE_NCU_TIMEOUT:-300}" "$NCU" --clock-control none --kernel-name regex:'wgrad|adamw|elementwise' \
    --launch-skip 0 --launch-count 13 --section SpeedOfLight --section Occupancy --section LaunchStats \
    --section SchedulerStats --section WarpStateStats --section MemoryWorkloadAnalysis \
    --section ComputeWorkloadAnalysis --section InstructionStats \
    --section SourceCounters \
    --metrics smsp__inst_executed.sum,smsp__thread_inst_executed.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum,regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio \
    "$BUILD/bench/wgrad_bench" --profile >"$OUT/ncu.txt" 2>&1
  echo "ncu rc=$? after $(elapsed) s"
  grep -E "wgrad|adamw|Duration|Compute \(SM\) Throughput|Memory Throughput|DRAM Throughput|Issue Slots Busy|Warp Cycles Per Issued|No Eligible|Achieved Occupancy|Stall|inst_executed|hmma|mem_shared|Executed Ipc" "$OUT/ncu.txt" | head -100
  exit 0
fi

# Builds only the benchmark into build dir $1, with extra CUDA flags $2 (trace and ab modes),
# from source tree $3 (default: this checkout).
build_bench() {
  cmake -S "${3:-$ROOT}" -B "$1" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES="$ARCHS" \
    -DFORGE_BUILD_TESTS=OFF -DFORGE_BUILD_BENCH=ON -DCMAKE_CUDA_FLAGS="$2" >"$1.log" 2>&1 &&
    cmake --build "$1" --target wgrad_bench -j "$JOBS" >>"$1.log" 2>&1
}

if [ "${1:-}" = soak ]; then
  # `bash scripts/gpu_check.sh soak`: is the fused step held by the card's power cap? Runs
  # `wgrad_bench --soak` (each variant of gate_proj back to back for FORGE_SOAK_SECONDS, default
  # 5, at each T of FORGE_SOAK_TOKENS, default 512,4096: ms per call, SM clock, power, energy
  # per call) with the library's kernel choice and again with the two-CTA kernel only
  # (FORGE_DEBUG_PERSISTENT=0), then Nsight Compute (clocks left alone) on one launch each of
  # the persistent fused kernel and cuBLAS's dW kernel at the largest T: throughputs of the
  # tensor pipe, shared memory, L2 and DRAM, side by side. Results: $OUT/soak/soak.md,
  # $OUT/soak-2cta/soak.md, $OUT/ncu-soak.txt. Takes FORGE_GPU_PREBUILT.
  NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  bench_bin=$BUILD/bench/wgrad_bench
  if [ -z "$PREBUILT" ]; then
    log "soak: build the benchmark"
    build_bench "$BUILD-bench" "" || { tail -30 "$BUILD-bench.log"; exit 1; }
    bench_bin=$BUILD-bench/bench/wgrad_bench
  fi
  secs=${FORGE_SOAK_SECONDS:-5}
  tokens=${FORGE_SOAK_TOKENS:-512,4096}
  t_max=$(echo "$tokens" | tr ',' '\n' | sort -n | tail -1)
  for run in "soak|" "soak-2cta|FORGE_DEBUG_PERSISTENT=0"; do
    IFS='|' read -r label setting <<<"$run"
    log "soak: $label"
    env $setting timeout "$(limit 300 120)" "$bench_bin" --soak "$secs" --tokens "$tokens" \
      --out "$OUT/$label" >"$OUT/$label.txt" 2>&1 || log "soak: $label failed: $(tail -2 "$OUT/$label.txt")"
    cat "$OUT/$label/soak.md" 2>/dev/null
  done
  if [ -n "$NCU" ]; then
    : >"$OUT/ncu-soak.txt"
    for kernel in "regex:wgrad_wgmma_persistent" "regex:nvjet|gemm|xmma"; do
      log "soak: ncu on $kernel, T = $t_max"
      # (--launch-skip 3: past the warm-up calls' first launches)
      timeout "$(limit 120 0)" "$NCU" --clock-control none -k "$kernel" --launch-skip 3 --launch-count 1 \
        --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
        --section Occupancy --metrics sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum,lts__t_sectors_srcunit_tex.sum \
        "$bench_bin" --soak 2 --tokens "$t_max" --out "$OUT/ncu-soak-run" >>"$OUT/ncu-soak.txt" 2>&1
    done
    grep -E "wgrad|nvjet|gemm|xmma|Duration|SM Frequency|Throughput|Pipe|hmma|Busy|Bandwidth|Hit Rate|mem_shared|Executed Ipc|Achieved Occ" \
      "$OUT/ncu-soak.txt" | head -70
  fi
  exit 0
fi

if [ "${1:-}" = ab ]; then
  # `bash scripts/gpu_check.sh ab`: A/B of benchmark settings, in one call. Builds only the
  # benchmark (and one more build per "|"-separated set of compile definitions in
  # FORGE_AB_DEFS, run with its defaults), then runs the full wgrad_bench FORGE_AB_REPS times
  # (default 3) per setting of FORGE_AB_SETTINGS (space-separated, each "default" or
  # VAR=value[,VAR=value...], where an item may also be a wgrad_bench flag such as
  # --reverse-shapes, or --flag=value for "--flag value"; default "default"), reversing the
  # order of the runs every other repetition, and prints bench/ab_totals.py's medians and
  # lowest-highest ranges. The card's clock moves between runs:
  # compare only within one call. Results:
  # $OUT/<label>-r<rep>/bench.md and bench.json, and setting.txt: the run's setting as given
  # (the label drops its underscores), for `bench/record.py --ab "$(cat setting.txt)"`; a
  # baseline build's runs say "default", their binary's path in the recorded command.
  # FORGE_AB_BASELINE=<commit> also builds the benchmark at that commit (a git worktree) and
  # runs it as the setting "base": a code change against its parent in one call. A build tree
  # holding bench/wgrad_bench (made beforehand) is taken as it is. Several (space-separated)
  # run as "base", "base2", ...: variants built beforehand, each against the others.
  # FORGE_AB_ARGS: more arguments for every run (e.g. --quick: T = 512 only). An earlier ab
  # call's results in $OUT (a machine kept warm between calls) are removed first: the medians
  # would mix them in.
  rm -rf "$OUT"/*-r[0-9]*
  bench_bin=$BUILD-bench/bench/wgrad_bench
  [ -n "$PREBUILT" ] && bench_bin=$BUILD/bench/wgrad_bench
  IFS='|' read -ra defsets <<<"${FORGE_AB_DEFS:-}"
  if [ -n "$PREBUILT" ] && ((${#defsets[@]})); then
    echo "FORGE_AB_DEFS needs builds here: leave FORGE_GPU_PREBUILT unset" >&2
    exit 1
  fi
  pids=()
  if [ -z "$PREBUILT" ]; then
    log "ab: build the benchmark${FORGE_AB_DEFS:+ (and with $FORGE_AB_DEFS)}"
    build_bench "$BUILD-bench" "" &
    pids=($!)
  fi
  for i in "${!defsets[@]}"; do
    build_bench "$BUILD-bench-defs$((i + 1))" "${defsets[$i]}" &
    pids+=($!)
  done
  runs=()  # "binary|label|setting"
  j=0
  for baseline in ${FORGE_AB_BASELINE:-}; do
    j=$((j + 1))
    label=base
    ((j > 1)) && label=base$j
    if [ -x "$baseline/bench/wgrad_bench" ]; then
      runs+=("$baseline/bench/wgrad_bench|$label|default")  # a build tree made beforehand
    else
      rm -rf "$BUILD-$label-src"
      git -C "$ROOT" worktree prune
      git -C "$ROOT" worktree add -f --detach "$BUILD-$label-src" "$baseline" >/dev/null || exit 1
      build_bench "$BUILD-bench-$label" "" "$BUILD-$label-src" &
      pids+=($!)
      runs+=("$BUILD-bench-$label/bench/wgrad_bench|$label|default")
    fi
  done
  for i in "${!pids[@]}"; do
    wait "${pids[$i]}" || { log "ab: build $i failed"; tail -20 "$BUILD-bench"*.log; exit 1; }
  done
  for setting in ${FORGE_AB_SETTINGS:-default}; do
    runs+=("$bench_bin|$(echo "$setting" | sed 's/FORGE_DEBUG_//g; s/[^A-Za-z0-9=,]//g')|$setting")
  done
  for i in "${!defsets[@]}"; do
    runs+=("$BUILD-bench-defs$((i + 1))/bench/wgrad_bench|defs$((i + 1))|default")
    echo "defs$((i + 1)): ${defsets[$i]}"
  done
  # The card's clocks, power, temperature and clock-event reasons every 100 ms during the runs
  # ($OUT/clocks.csv), and each run's start in the same local time ($OUT/runs.log): whether a
  # slow run ran slowed down.
  clock_pid=
  : >"$OUT/runs.log"
  if command -v nvidia-smi >/dev/null; then
    fields=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu
    for extra in clocks_event_reasons.active clocks_throttle_reasons.active; do
      nvidia-smi --query-gpu="$fields,$extra" --format=csv >/dev/null 2>&1 && {
        fields=$fields,$extra
        break
      }
    done
    nvidia-smi --query-gpu="$fields" --format=csv -lms 100 >"$OUT/clocks.csv" 2>&1 &
    clock_pid=$!
  fi
  for rep in $(seq 1 "${FORGE_AB_REPS:-3}"); do
    order=("${runs[@]}")
    if ((rep % 2 == 0)); then  # every other repetition in reverse order
      order=()
      for ((j = ${#runs[@]} - 1; j >= 0; j--)); do order+=("${runs[$j]}"); done
    fi
    for run in "${order[@]}"; do
      IFS='|' read -r bin label setting <<<"$run"
      d="$OUT/$label-r$rep"
      mkdir -p "$d"
      echo "$setting" >"$d/setting.txt"
      # A setting's VAR=value items go to the environment, its --flag items to the command line.
      env_args=() arg_items=()
      if [ "$setting" != default ]; then
        IFS=',' read -ra items <<<"$setting"
        for item in "${items[@]}"; do
          case $item in
            --*=*) arg_items+=("${item%%=*}" "${item#*=}") ;;  # --iters=60: --iters 60
            --*) arg_items+=("$item") ;;
            *) env_args+=("$item") ;;
          esac
        done
      fi
      echo "$(date '+%Y/%m/%d %H:%M:%S.%N' | cut -c1-23) start $label rep $rep" >>"$OUT/runs.log"
      # each benchmark with its own build's library (the runpath yields to LD_LIBRARY_PATH)
      env LD_LIBRARY_PATH="$(dirname "$(dirname "$bin")")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
        "${env_args[@]}" timeout "$(limit 120 0)" "$bin" ${FORGE_AB_ARGS:-} "${arg_items[@]}" --out "$d" >"$d/console.txt" 2>&1 ||
        log "ab: $label rep $rep failed: $(tail -2 "$d/console.txt")"
    done
  done
  echo "$(date '+%Y/%m/%d %H:%M:%S.%N' | cut -c1-23) end" >>"$OUT/runs.log"
  [ -n "$clock_pid" ] && kill "$clock_pid" 2>/dev/null
  python3 "$ROOT/bench/ab_totals.py" "$OUT"
  exit 0
fi

if [ "${1:-}" = trace ]; then
  # `bash scripts/gpu_check.sh trace`: build only the benchmark and run `wgrad_bench --trace`
  # (time + per-CTA phase trace of a few layers) FORGE_TRACE_REPS times
  # (default 1) per setting in FORGE_TRACE_SETTINGS: space-separated, each "default" or
  # VAR=value[,VAR=value...] of FORGE_DEBUG_* knobs (default: "default
  # FORGE_DEBUG_STAGGER_NS=0"). FORGE_TRACE_DEFS: "|"-separated sets of compile definitions
  # of experiments (e.g. "-DFORGE_X=1|-DFORGE_X=2"), each built too and run with "default".
  # Results: $OUT/<build>-<setting>-r<rep>/trace.md (+ raw CSVs), and bench/trace_sweep.py's
  # table of medians over the repetitions.
  log "trace: build the benchmark${FORGE_TRACE_DEFS:+ (and with $FORGE_TRACE_DEFS)}"
  declare -A pids
  build_bench "$BUILD-bench" "" &
  pids[default]=$!
  IFS='|' read -ra defsets <<<"${FORGE_TRACE_DEFS:-}"
  for i in "${!defsets[@]}"; do
    build_bench "$BUILD-bench-defs$((i + 1))" "${defsets[$i]}" &
    pids[defs$((i + 1))]=$!
  done
  builds=()
  for b in default $(for i in "${!defsets[@]}"; do echo "defs$((i + 1))"; done); do
    if wait "${pids[$b]}"; then builds+=("$b"); else
      log "trace: build $b failed"; tail -20 "$BUILD-bench${b#default}.log"; fi
  done
  [ "${builds[0]:-}" = default ] || exit 1
  for i in "${!defsets[@]}"; do echo "defs$((i + 1)): ${defsets[$i]}"; done
  for rep in $(seq 1 "${FORGE_TRACE_REPS:-1}"); do
    for b in "${builds[@]}"; do
      bin=$BUILD-bench/bench/wgrad_bench
      settings=${FORGE_TRACE_SETTINGS:-default FORGE_DEBUG_STAGGER_NS=0}
      if [ "$b" != default ]; then bin=$BUILD-bench-$b/bench/wgrad_bench; settings=default; fi
      for setting in $settings; do
        label=$(echo "$setting" | sed 's/FORGE_DEBUG_//g; s/[^A-Za-z0-9=,]//g')
        d="$OUT/$b-$label-r$rep"
        mkdir -p "$d"
        env_args=()
        [ "$setting" != default ] && IFS=',' read -ra env_args <<<"$setting"
        env "${env_args[@]}" timeout "$(limit 120 0)" "$bin" --trace --out "$d" >"$d/console.txt" 2>&1 ||
          log "trace: $b $setting rep $rep failed: $(tail -2 "$d/console.txt")"
      done
    done
  done
  python3 "$ROOT/bench/trace_sweep.py" "$OUT"
  exit 0
fi

# ---- 1. build -----------------------------------------------------------------------------
{
  echo "== $(date -u)"; nvidia-smi 2>&1 | head -15; nvcc --version | tail -2; cmake --version | head -1
} >"$OUT/build.log" 2>&1
t0=$(elapsed)
CMAKE_EXTRA=()
if ! ls /usr/lib/*/cmake/GTest/GTestConfig.cmake /usr/local/lib*/cmake/GTest/GTestConfig.cmake \
    /usr/lib/cmake/GTest/GTestConfig.cmake >/dev/null 2>&1 && [ ! -f /usr/include/gtest/gtest.h ]; then
  if [ -d "$ROOT/build-deps/googletest" ]; then
    log "no system GoogleTest: building build-deps/googletest"
    {
      cmake -S "$ROOT/build-deps/googletest" -B "$ROOT/build-deps/gtest-build" -G Ninja \
        -DCMAKE_BUILD_TYPE=Release -DBUILD_GMOCK=OFF -DCMAKE_POSITION_INDEPENDENT_CODE=ON \
        -DCMAKE_INSTALL_PREFIX="$ROOT/build-deps/gtest-install" &&
        cmake --build "$ROOT/build-deps/gtest-build" -j "$JOBS" &&
        cmake --install "$ROOT/build-deps/gtest-build"
    } >>"$OUT/build.log" 2>&1
    CMAKE_EXTRA+=("-DCMAKE_PREFIX_PATH=$ROOT/build-deps/gtest-install")
  else
    log "no GoogleTest on this machine and no build-deps/googletest: the configure step will fail"
  fi
fi
if [ -n "$PREBUILT" ]; then
  log "prebuilt: $BUILD (archs $(sed -n 's/^CMAKE_CUDA_ARCHITECTURES:[A-Z]*=//p' "$BUILD/CMakeCache.txt"))"
  true
else
  log "configure + build (CUDA archs $ARCHS)"
  timeout "$(limit 300 140)" bash -c "cmake -S '$ROOT' -B '$BUILD' -G Ninja -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_CUDA_ARCHITECTURES='$ARCHS' -DCMAKE_CUDA_FLAGS='${FORGE_GPU_CHECK_CUDA_FLAGS:-}' \
      ${CMAKE_EXTRA[*]:-} && cmake --build '$BUILD' -j $JOBS" \
    >>"$OUT/build.log" 2>&1
fi
build_rc=$?
if [ -n "$PREBUILT" ]; then
  row build "prebuilt ($BUILD)" "0 s"
elif ((build_rc == 0)); then
  row build "ok (archs $ARCHS)" "$(($(elapsed) - t0)) s"
else
  row build "FAILED rc=$build_rc (see build.log)" "$(($(elapsed) - t0)) s"
  tail -40 "$OUT/build.log"
fi

# Parses a ctest log into "passed/total passed, N failed, M skipped".
ctest_result() {
  local logf=$1 total failed skipped
  # "100% tests passed, 0 tests failed out of N" or "100% tests passed out of N"
  total=$(grep -E "tests passed.*out of [0-9]+" "$logf" | grep -oE "[0-9]+$" | tail -1)
  failed=$(grep -oE "[0-9]+ tests failed out of" "$logf" | grep -oE "^[0-9]+" | tail -1)
  failed=${failed:-0}
  skipped=$(grep -cE "\*\*\*Skipped" "$logf")
  if [ -z "$total" ]; then echo "no result (timed out or did not run)"; return; fi
  echo "$((total - failed))/$total passed, $failed failed, $skipped skipped"
}

# The directory under $OUT of one sweep setting VAR=value.
sweep_dir() { echo "sweep-${1//[^A-Za-z0-9_]/-}"; }

if ((build_rc == 0)); then
  # ---- 2. GPU tests, then the benchmark -----------------------------------------------------
  if [ "$TESTS" != 0 ]; then
  t0=$(elapsed)
  log "ctest -L gpu"
  # NOTE: 8 test processes share the GPU; each CPU reference gets 2 OpenMP threads.
  # The reserve for the steps after it: the benchmark alone in quick mode, everything below
  # in full mode (the two subsets, the benchmarks, the sanitizers and the CPU suite take
  # about 300 s on an H100).
  OMP_NUM_THREADS=2 timeout "$(limit 250 "$([ "$QUICK" = 1 ] && echo 40 || echo 280)")" \
    ctest --test-dir "$BUILD" -L gpu -j 8 \
    --output-on-failure --timeout 300 >"$OUT/ctest_gpu.log" 2>&1
  row "ctest -L gpu" "$(ctest_result "$OUT/ctest_gpu.log")" "$(($(elapsed) - t0)) s"
  grep -E "tests passed|\*\*\*Failed|\*\*\*Timeout|\*\*\*Exception" "$OUT/ctest_gpu.log" | head -30
  fi

  if [ "$QUICK" != 1 ] && [ "$TESTS" != 0 ]; then
  # The portable mma.sync kernels again (on a Hopper GPU the suite above ran the wgmma main
  # loop): the bit-exact and shape/layout tests, which reach every kernel variant.
  t0=$(elapsed)
  log "ctest -L gpu, sm80 path (FORGE_DEBUG_WGMMA=0)"
  FORGE_DEBUG_WGMMA=0 OMP_NUM_THREADS=2 timeout "$(limit 120 200)" ctest --test-dir "$BUILD" -L gpu -j 8 \
    -R 'WgradExact|WgradNonFinite|WgradOddShapes|WgradInputs|WgradSplitK|ManyWaves|WgradStorable|WgradBlockSkipped|WgradShards' \
    --output-on-failure --timeout 300 >"$OUT/ctest_gpu_sm80.log" 2>&1
  row "ctest -L gpu (sm80 path, Wgrad bit-exact subset)" "$(ctest_result "$OUT/ctest_gpu_sm80.log")" \
    "$(($(elapsed) - t0)) s"
  grep -E "tests passed|\*\*\*Failed|\*\*\*Timeout|\*\*\*Exception" "$OUT/ctest_gpu_sm80.log" | head -30

  # The persistent Hopper kernel, forced on every layer it applies to (FORGE_DEBUG_PERSISTENT=1;
  # by default only large layers at T >= 1024 run it), with its grid capped at 3 CTAs so that
  # every test layer runs several tiles per CTA.
  t0=$(elapsed)
  log "ctest -L gpu, persistent kernel (FORGE_DEBUG_PERSISTENT=1, 3 CTAs)"
  FORGE_DEBUG_PERSISTENT=1 FORGE_DEBUG_PERSISTENT_CTAS=3 OMP_NUM_THREADS=2 \
    timeout "$(limit 140 100)" ctest --test-dir "$BUILD" -L gpu -j 8 \
    -R 'WgradExact|WgradNonFinite|WgradOddShapes|WgradInputs|WgradRandom|ManyWaves|WgradRunScalars|CudaGraph|WgradStorable|WgradBlockSkipped|WgradShards' \
    --output-on-failure --timeout 120 >"$OUT/ctest_gpu_persistent.log" 2>&1
  row "ctest -L gpu (persistent kernel, Wgrad subset)" \
    "$(ctest_result "$OUT/ctest_gpu_persistent.log")" "$(($(elapsed) - t0)) s"
  grep -E "tests passed|\*\*\*Failed|\*\*\*Timeout|\*\*\*Exception" "$OUT/ctest_gpu_persistent.log" | head -10
  fi

  t0=$(elapsed)
  log "benchmark (default path, then FORGE_DEBUG_WGMMA=0 into $OUT/sm80)"
  FORGE_DEBUG_LOG=1 timeout "$(limit 150 80)" "$BUILD/bench/wgrad_bench" --out "$OUT" \
    >"$OUT/bench.log" 2>&1
  bench_rc=$?
  # The unfused way as torch runs it (cuBLAS dW through torch.mm + torch's fused AdamW kernel)
  # against the same fused step, from Python: bench/torch_unfused.py, into torch-unfused.md.
  if python3 -c "import torch; assert torch.cuda.is_available()" 2>/dev/null; then
    FORGE_LIBRARY="$BUILD" timeout "$(limit 90 60)" python3 "$ROOT/bench/torch_unfused.py" \
      --out "$OUT" >"$OUT/torch_unfused.log" 2>&1
    others="; torch_unfused.py rc=$?"
  else
    others="; torch_unfused.py skipped (no torch with CUDA)"
  fi
  for setting in $SWEEP; do
    dir="$OUT/$(sweep_dir "$setting")"
    mkdir -p "$dir"
    env "$setting" timeout "$(limit 60 40)" "$BUILD/bench/wgrad_bench" --out "$dir" \
      >"$dir/bench.log" 2>&1
    others="$others; $setting rc=$?"
  done
  if [ "$QUICK" != 1 ]; then
    mkdir -p "$OUT/sm80"
    FORGE_DEBUG_WGMMA=0 timeout "$(limit 150 70)" "$BUILD/bench/wgrad_bench" --out "$OUT/sm80" \
      >"$OUT/sm80/bench.log" 2>&1
    others="$others; sm80 path rc=$?"
    mkdir -p "$OUT/persistent"
    FORGE_DEBUG_PERSISTENT=1 timeout "$(limit 150 60)" "$BUILD/bench/wgrad_bench" --out "$OUT/persistent" \
      >"$OUT/persistent/bench.log" 2>&1
    others="$others; persistent rc=$?"
  fi
  row benchmark "$([ $bench_rc = 0 ] && echo ok || echo "FAILED rc=$bench_rc (bench.log)")$others" \
    "$(($(elapsed) - t0)) s"

  if [ "$QUICK" != 1 ] && [ "$TESTS" != 0 ]; then
  # ---- 3. compute-sanitizer ------------------------------------------------------------------
  # One bf16 tensor-core path per storage family, split-K, odd shapes and unaligned inputs
  # (element-load fallback), non-finite gradients and updates that are not storable, int8
  # blocks holding skipped elements, fp32/mixed SIMT, elementwise and state kernels (with
  # state_from_fp32's refusals), refused run scalars in a replayed graph, the bad-input cases,
  # shards. Racecheck (shared memory) on the kernels that use it. (BadDeviceIndex is left
  # out of memcheck: its cudaSetDevice error is the point of the test, and memcheck reports
  # every failing API call.)
  MEMCHECK_FILTER='*WgradExact*/AdamW_Wbf16_Sint8:*WgradExact*/RMSpropCenteredMomentum_Wbf16master_Sbf16sr:*WgradExact*/SGDNesterov_Wfp32_Sfp32:*WgradInputs*:*WgradOddShapes*/out17_in129_T17:*WgradOddShapes*/out1_in1000_T1:*WgradOddShapes*/out129_in17_T4097:*WgradSplitK.SmallLayer*:*WgradNonFinite*/Wbf16sr_Sint8:*WgradExact*/AdamW_Wbf16sr_Sfp8:*ElementwiseExact*/AdamW_Wbf16sr_Sint8:*ElementwiseExact*/AdamW_Wbf16sr_Sfp8:*ElementwiseExact*/Lion_Wfp32_Sbf16:*StateOps*:*GpuErrors*:*WgradStorable*:*WgradBlockSkipped*:*ElementwiseStorable*:*ElementwiseBlockSkipped*:*StateFromFp32*:*CudaGraph.Mismatched*:*WgradShards*/AdamW_Wbf16sr_Sint8:*WgradShards*/AdamW_Wbf16sr_Sbf16sr_unaligned:*ElementwiseShards*/AdamW_Wbf16sr_Sint8:-*BadDeviceIndex*'
  RACECHECK_FILTER='*WgradExact*/AdamW_Wbf16_Sint8:*WgradSplitK.SmallLayer*:*WgradInputs*/bf16_strided_unaligned:*WgradInputs*/fp32:*ElementwiseExact*/AdamW_Wfp32_Sint8'
  : >"$OUT/sanitizer.log"
  SANITIZER=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer \
    /usr/local/cuda/compute-sanitizer/compute-sanitizer 2>/dev/null | head -1)
  # One sanitizer run: sanitize LABEL TOOL FILTER CAP RESERVE [VAR=value ...] (environment).
  sanitize() {
    local label=$1 tool=$2 filter=$3 cap=$4 reserve=$5 t0 rc summary_line ran
    shift 5
    t0=$(elapsed)
    log "compute-sanitizer --tool $tool${label:+, $label}"
    echo "===== ${label:+$label: }compute-sanitizer --tool $tool --gtest_filter=$filter" >>"$OUT/sanitizer.log"
    env "$@" OMP_NUM_THREADS=$JOBS timeout "$(limit "$cap" "$reserve")" "$SANITIZER" --tool "$tool" \
      --error-exitcode 99 "$BUILD/tests/cpp/gpu/forge_gpu_tests" --gtest_filter="$filter" \
      >>"$OUT/sanitizer.log" 2>&1
    rc=$?
    summary_line=$(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$OUT/sanitizer.log" | tail -1)
    ran=$(grep -oE "\[  PASSED  \] [0-9]+ test" "$OUT/sanitizer.log" | tail -1)
    row "compute-sanitizer $tool${label:+ ($label)}" \
      "rc=$rc; ${summary_line:-no summary}; ${ran:-no pass line}" "$(($(elapsed) - t0)) s"
  }
  sanitize "" memcheck "$MEMCHECK_FILTER" 150 60
  sanitize "" racecheck "$RACECHECK_FILTER" 120 25
  # The persistent kernel (forced, 3 CTAs: several tiles per CTA), a specialized and a generic
  # configuration, odd shapes, non-finite gradients, int8 blocks holding skipped elements,
  # refused run scalars.
  PERSISTENT_FILTER='*WgradExact*/AdamW_Wbf16_Sint8:*WgradExact*/RMSpropCenteredMomentum_Wbf16master_Sbf16sr:*WgradOddShapes*/out129_in17_T4097:*WgradNonFinite*/Wbf16sr_Sint8:*WgradBlockSkipped*:*CudaGraph.Mismatched*'
  sanitize "persistent kernel" memcheck "$PERSISTENT_FILTER" 90 40 FORGE_DEBUG_PERSISTENT=1 \
    FORGE_DEBUG_PERSISTENT_CTAS=3
  # (racecheck without the second block-skipped case: the same kernel and shared-memory
  # protocol as the first, many more steps, over 100 s under racecheck on an H100)
  sanitize "persistent kernel" racecheck "${PERSISTENT_FILTER/\*WgradBlockSkipped\*/*WgradBlockSkipped.Keeps*}" \
    90 20 FORGE_DEBUG_PERSISTENT=1 \
    FORGE_DEBUG_PERSISTENT_CTAS=3

  # ---- 4. CPU tests --------------------------------------------------------------------------
  t0=$(elapsed)
  log "ctest -L cpu"
  OMP_NUM_THREADS=2 timeout "$(limit 120 5)" ctest --test-dir "$BUILD" -L cpu -j 8 \
    --output-on-failure >"$OUT/ctest_cpu.log" 2>&1
  row "ctest -L cpu" "$(ctest_result "$OUT/ctest_cpu.log")" "$(($(elapsed) - t0)) s"
  fi
fi

# ---- summary (last) ---------------------------------------------------------------------------
{
  echo "# gpu_check $(date -u +%Y-%m-%dT%H:%MZ) on $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)"
  echo
  echo "| step | result | time |"
  echo "| --- | --- | --- |"
  printf '%s\n' "${SUMMARY[@]}"
  echo "| total | | $(elapsed) s |"
} >"$OUT/summary.md"
# NOTE: the device tool returns at most 8 files from $OUT: keep the tables, pack the logs.
[ -f "$OUT/sm80/bench.md" ] && cp "$OUT/sm80/bench.md" "$OUT/bench-sm80.md"
[ -f "$OUT/persistent/bench.md" ] && cp "$OUT/persistent/bench.md" "$OUT/bench-persistent.md"
SWEEP_DIRS=$(cd "$OUT" && ls -d sweep-* 2>/dev/null)
(cd "$OUT" && tar czf logs.tgz --ignore-failed-read build.log ctest_gpu.log ctest_gpu_sm80.log \
  ctest_gpu_persistent.log ctest_cpu.log sanitizer.log bench.log sm80 persistent ncu.txt \
  torch_unfused.log torch-unfused.json $SWEEP_DIRS 2>/dev/null &&
  rm -rf build.log ctest_gpu.log ctest_gpu_sm80.log ctest_gpu_persistent.log ctest_cpu.log \
    sanitizer.log bench.log sm80 persistent torch_unfused.log torch-unfused.json $SWEEP_DIRS)
[ -f "$OUT/bench.md" ] && cat "$OUT/bench.md"
[ -f "$OUT/torch-unfused.md" ] && { echo; echo "## against cuBLAS dW + torch's fused AdamW (bench/torch_unfused.py), Llama-3.1-8B totals"; grep -A6 "^Llama-3.1-8B totals" "$OUT/torch-unfused.md" | tail -5; }
[ -f "$OUT/bench-sm80.md" ] && { echo; echo "## sm80 path (FORGE_DEBUG_WGMMA=0), Llama-3.1-8B totals"; grep -A5 "all 224 linear layers" "$OUT/bench-sm80.md" | tail -4; }
for setting in $SWEEP; do
  echo; echo "## $setting: Llama-3.1-8B totals and the 4096×4096 rows (full table in logs.tgz)"
  tar xzf "$OUT/logs.tgz" -O "$(sweep_dir "$setting")/bench.md" 2>/dev/null |
    grep -E "^\| (q_proj|512 |2048 |4096 )"
done
[ -f "$OUT/bench-persistent.md" ] && { echo; echo "## persistent kernel (FORGE_DEBUG_PERSISTENT=1), Llama-3.1-8B totals"; grep -A5 "all 224 linear layers" "$OUT/bench-persistent.md" | tail -4; }
echo
cat "$OUT/summary.md"
