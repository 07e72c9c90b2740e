# Run 98 (device): the persistent kernel with 11 update warps (build-wg3, -DFORGE_PERSISTENT_UPDATE_WARPS=11)
# against 8 (build-sm90): correctness forced, sanitizers, then an interleaved A/B at T = 512-2048.
set -u
R=bench/results/2026-11-30-h200-run98-update-warps
S=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
t0=$SECONDS
echo "== CudaGraph repeat (NOTES v20 item 0)"
timeout 100 ctest --test-dir build-sm90 -L gpu -j 8 -R 'WgradRunScalars|CudaGraph' --repeat until-fail:6 \
  --output-on-failure --timeout 60 > $OUT/cudagraph-repeat.log 2>&1; echo rc=$? $((SECONDS-t0))s; tail -4 $OUT/cudagraph-repeat.log
echo "== 11 update warps, forced persistent subset"
FORGE_CUDA_PERSISTENT=1 FORGE_CUDA_PERSISTENT_CTAS=3 timeout 150 ctest --test-dir build-wg3 -L gpu -j 8 \
  -R 'WgradExact|WgradNonFinite|WgradOddShapes|WgradInputs|WgradRandom|ManyWaves|WgradRunScalars|CudaGraph' \
  --output-on-failure --timeout 120 > $OUT/wg3-persistent.log 2>&1; echo rc=$? $((SECONDS-t0))s
grep -E "tests passed|\*\*\*Failed|\*\*\*Timeout|\*\*\*Exception" $OUT/wg3-persistent.log | head -12
F='*WgradExact*/AdamW_Wbf16_Sbf16:*WgradExact*/AdamW_Wbf16_Sint8:*WgradOddShapes*/out129_in17_T4097:*WgradNonFinite*/Wbf16sr_Sint8'
for tool in memcheck racecheck; do
  FORGE_CUDA_PERSISTENT=1 FORGE_CUDA_PERSISTENT_CTAS=3 timeout 80 $S --tool $tool --error-exitcode 99 \
    build-wg3/tests/cpp/gpu/forge_gpu_tests --gtest_filter="$F" > $OUT/wg3-$tool.log 2>&1
  echo "$tool rc=$? $((SECONDS-t0))s $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' $OUT/wg3-$tool.log | tail -1) $(grep -oE '\[  PASSED  \] [0-9]+ test' $OUT/wg3-$tool.log)"
done
echo "== A/B"
BENCH_ARGS="--tokens 512,1024,2048" bash bench/results/2026-11-30-h200-run81-tile-loop/abpair.sh 3 auto:build-sm90 p8:build-sm90:FORGE_CUDA_PERSISTENT=1 \
  p11:build-wg3:FORGE_CUDA_PERSISTENT=1 > $OUT/ab.md 2>&1; echo $((SECONDS-t0))s; cat $OUT/ab.md
echo "== trace, 11 update warps, T = 512"
FORGE_CUDA_PERSISTENT=1 LD_LIBRARY_PATH=$PWD/build-wg3 timeout 60 build-wg3/bench/wgrad_bench --tokens 512 --trace \
  --out /tmp/tr11 > $OUT/trace11.txt 2>&1; echo $((SECONDS-t0))s
cp /tmp/tr11/*.md $OUT/ 2>/dev/null
tar czf $OUT/ab-raw.tgz -C /tmp ab
