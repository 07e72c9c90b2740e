# Run 101 (device): the wide two-CTA kernel (FORGE_CUDA_WIDE=1: 512 threads, 4 warpgroups of
# m64n64, one quad per update thread): correctness, sanitizers, then an interleaved A/B.
set -u
R=bench/results/2026-11-30-h200-run98-update-warps
S=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
t0=$SECONDS
echo "== wide kernel, Wgrad subset (persistent off)"
FORGE_CUDA_WIDE=1 FORGE_CUDA_PERSISTENT=0 timeout 150 ctest --test-dir build-sm90 -L gpu -j 8 \
  -R 'WgradExact|WgradNonFinite|WgradOddShapes|WgradInputs|WgradRandom|ManyWaves|WgradManyTiles|WgradPoisoned|WgradDw|WgradFp32|WgradSplitK' \
  --output-on-failure --timeout 120 > $OUT/wide-ctest.log 2>&1; echo rc=$? $((SECONDS-t0))s
grep -E "tests passed|\*\*\*Failed|\*\*\*Timeout|\*\*\*Exception" $OUT/wide-ctest.log | head -12
FORGE_CUDA_WIDE=1 FORGE_CUDA_VERBOSE=1 build-sm90/tests/cpp/gpu/forge_gpu_tests --gtest_filter='*WgradManyTiles*:*WgradExact*/AdamW_Wbf16_Sbf16' 2>&1 | grep -o "wgrad_wgmma[a-z_]*<[^>]*>" | sort | uniq -c | head
F='*WgradExact*/AdamW_Wbf16_Sbf16:*WgradExact*/AdamW_Wbf16sr_Sint8:*WgradOddShapes*:*WgradManyTiles*'
for tool in memcheck racecheck; do
  FORGE_CUDA_WIDE=1 FORGE_CUDA_PERSISTENT=0 timeout 100 $S --tool $tool --error-exitcode 99 \
    build-sm90/tests/cpp/gpu/forge_gpu_tests --gtest_filter="$F" > $OUT/wide-$tool.log 2>&1
  echo "$tool rc=$? $((SECONDS-t0))s $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' $OUT/wide-$tool.log | tail -1) $(grep -oE '\[  PASSED  \] [0-9]+ test' $OUT/wide-$tool.log)"
done
echo "== A/B"
BENCH_ARGS="--tokens 512,1024,2048,4096" bash bench/results/2026-11-30-h200-run81-tile-loop/abpair.sh 3 base:build-sm90 wide:build-sm90:FORGE_CUDA_WIDE=1 \
  'wide-np:build-sm90:FORGE_CUDA_WIDE=1 FORGE_CUDA_PERSISTENT=0' > $OUT/ab101.md 2>&1; echo $((SECONDS-t0))s; cat $OUT/ab101.md
echo "== trace"
FORGE_CUDA_WIDE=1 FORGE_CUDA_PERSISTENT=0 LD_LIBRARY_PATH=$PWD/build-sm90 timeout 60 build-sm90/bench/wgrad_bench --trace --out /tmp/trw > $OUT/trace-wide.txt 2>&1
FORGE_CUDA_PERSISTENT=0 LD_LIBRARY_PATH=$PWD/build-sm90 timeout 60 build-sm90/bench/wgrad_bench --trace --out /tmp/trb > $OUT/trace-base.txt 2>&1
echo $((SECONDS-t0))s
tar czf $OUT/ab101-raw.tgz -C /tmp ab
