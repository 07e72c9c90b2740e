#!/usr/bin/env bash
# gpu_python.sh — the Python-side proof, run on one GPU machine (H200, torch + transformers):
#   1. builds libforge with its CUDA backend into build-gpu/ (incremental) unless
#      FORGE_LIBRARY already names one;
#   1b. the host's cost per Linear per step, FORGE against torch (bench/host_overhead.py);
#   1c. the Python test suite on CUDA (pytest tests/python -m cuda, PYTEST_BUDGET_S);
#   2. forge-bench --suite anchors: peak memory and step time of the baselines' cases
#      (docs/performance.md) and their targets, most important first, within a time budget;
#   3. forge-bench --parity: ~100M model, bf16, PARITY_STEPS steps of real text (the
#      machine's Python library sources): FORGE bf16+SR and int8 against torch fused AdamW;
#   4. prints a short summary last.
# Everything stays under 9 minutes (TOTAL_BUDGET_S): each stage has a budget and a hard
# timeout, and results are written as they come, so a cut-short stage keeps its numbers.
# Results go to $OUT (default ./out), flat, at most 8 files: forge-bench-*.{md,json,csv,png},
# forge-parity-*.{json,png}, host-overhead.json and the full log gpu_python.log. Record the
# JSON files in the results table with `python3 bench/record.py $OUT/*.json`, then
# `python3 bench/render.py` (bench/results/README.md).
# Knobs (environment): OUT, PYTHON (python3), TOTAL_BUDGET_S (540), PYTEST_BUDGET_S (120; 0
# skips pytest), SKIP_PARITY (0; 1 skips stage 3), PARITY_STEPS (1000),
# PARITY_RESERVE_S (200: kept for the parity stage), PARITY_NOISE_RUNS (1: torch runs with
# perturbed initial weights that measure the noise floor, ~50 s each on the H200),
# PARITY_AMP_SEEDS (3: the mixed-precision reference over that many seeds, whose spread every
# run is held to; the extra seeds run last), BENCH_ARGS (extra forge-bench args).
set -uo pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-./out}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
LOG="$OUT/gpu_python.log"
: >"$LOG"
PY=${PYTHON:-python3}
TOTAL=${TOTAL_BUDGET_S:-540}
PARITY_STEPS=${PARITY_STEPS:-1000}
PARITY_RESERVE=${PARITY_RESERVE_S:-200}
t0=$(date +%s)
elapsed() { echo $(($(date +%s) - t0)); }
say() { echo "[gpu_python ${SECONDS}s] $*" | tee -a "$LOG"; }

# 1. libforge with the CUDA backend (sm_90a only: half the compile time of "80;90a").
if [ -z "${FORGE_LIBRARY:-}" ]; then
  command -v nvcc >/dev/null || export PATH="/usr/local/cuda/bin:$PATH"
  say "building libforge (CUDA, sm_90a) in build-gpu/"
  if cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DFORGE_CUDA=ON \
      -DCMAKE_CUDA_ARCHITECTURES=90a -DFORGE_BUILD_TESTS=OFF -DFORGE_BUILD_BENCH=OFF \
      >>"$LOG" 2>&1 && ninja -C build-gpu >>"$LOG" 2>&1; then
    export FORGE_LIBRARY="$PWD/build-gpu/libforge.so"
  else
    say "BUILD FAILED; the log's tail:"
    tail -25 "$LOG"
    exit 1
  fi
fi
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
if ! $PY -c "import torch, forge; assert torch.cuda.is_available(), 'no GPU'; \
assert forge.has_cuda(), 'libforge has no CUDA backend'; \
print('torch', torch.__version__, torch.cuda.get_device_name(), 'libforge', forge.library().path)" \
    2>&1 | tee -a "$LOG"; then
  say "environment check failed"
  exit 1
fi

# 1b. The host's cost per Linear per step, FORGE against torch (bench/host_overhead.py, ~40 s).
say "$(timeout 90 $PY bench/host_overhead.py --device cuda --dtype bf16 --rounds 4 \
  --json "$OUT/host-overhead.json" 2>&1 | tail -1)"

# 1c. The Python suite's GPU tests (the CPU ones run in CI); PYTEST_BUDGET_S=0 skips them.
if [ "${PYTEST_BUDGET_S:-120}" != 0 ]; then
  say "pytest tests/python (CUDA tests only, limit ${PYTEST_BUDGET_S:-120}s)"
  timeout "${PYTEST_BUDGET_S:-120}" $PY -m pytest tests/python -q -x -k "cuda" -p no:cacheprovider \
    -o console_output_style=classic 2>&1 | tee "$OUT/pytest_gpu.log" | tail -15
  say "pytest finished (status ${PIPESTATUS[0]})"
fi

# 2. The benchmark: what is left of the budget after keeping PARITY_RESERVE for stage 3.
bench_budget=$((TOTAL - $(elapsed) - PARITY_RESERVE - 20))
if ((bench_budget > 30)); then
  say "forge-bench --suite anchors (budget ${bench_budget}s)"
  # shellcheck disable=SC2086
  # FORGE_DEBUG_LOG: the log says which wgrad kernel each configuration ran (a generic
  # kernel where a specialized one was expected is a performance bug).
  FORGE_DEBUG_LOG=1 timeout $((bench_budget + 60)) $PY -m forge.tools.bench --suite anchors --time-budget "$bench_budget" \
    --out "$OUT" ${BENCH_ARGS:-} 2>&1 | tee -a "$LOG" | grep --line-buffered -E '^\[[0-9]+/|error'
  say "forge-bench finished (status ${PIPESTATUS[0]})"
else
  say "forge-bench skipped: only $((TOTAL - $(elapsed)))s left"
fi

# 3. Convergence parity with whatever time is left (the report is rewritten after each run).
parity_budget=$((TOTAL - $(elapsed) - 10))
[ "${SKIP_PARITY:-0}" = 1 ] && parity_budget=0
if ((parity_budget > 30)); then
  say "forge-bench --parity, ${PARITY_STEPS} steps (hard limit ${parity_budget}s)"
  timeout "$parity_budget" $PY -m forge.tools.bench --parity --parity-steps "$PARITY_STEPS" \
    --parity-noise-runs "${PARITY_NOISE_RUNS:-1}" --parity-amp-seeds "${PARITY_AMP_SEEDS:-3}" \
    --out "$OUT" --parity-work-dir /tmp/forge-parity 2>&1 | tee -a "$LOG" |
    grep --line-buffered -E '^forge-train: (model|done|error)|^parity|^  (forge|torch|report)'
  say "parity finished (status ${PIPESTATUS[0]}; 124 = cut by the time limit)"
else
  say "parity skipped: only $((TOTAL - $(elapsed)))s left"
fi

# 4. Summary, last.
echo
say "done in $(elapsed)s; files in $OUT:"
ls -1 "$OUT"
echo
$PY -m forge.tools.bench --summarize "$OUT" 2>&1 | tee -a "$LOG"
echo "kernels the benchmark ran (FORGE_DEBUG_LOG):"
grep -h "forge cuda: step runs" "$LOG" | sort -u | head -20
