set -u
cd /work/main
S=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null | head -1)
T0=$SECONDS
bash build-sm90/abpair.sh 4 base:build-base new:build-sm90 loop:build-sm90:FORGE_CUDA_TILE_LOOP=1 > $OUT/ab.md 2>&1
head -12 $OUT/ab.md; grep -A15 "Per layer, 'fused bf16 ms'" $OUT/ab.md
grep -h 'dW check' -A13 /tmp/ab/loop-r1/bench.md | cut -d'|' -f2,3,14 | tail -12 | sort -u -t'|' -k3 | head -3
echo "ab done $((SECONDS-T0)) s"
R='WgradExact|WgradNonFinite|WgradOddShapes|WgradInputs|WgradRandom|WgradSplitK|ManyWaves|ManyTiles'
FORGE_CUDA_TILE_LOOP=3 OMP_NUM_THREADS=2 timeout 150 ctest --test-dir build-sm90 -L gpu -j 8 -R "$R" > $OUT/ctest-loop3.txt 2>&1; echo "loop3: $(grep 'tests passed' $OUT/ctest-loop3.txt)"; grep -i 'failed\b' $OUT/ctest-loop3.txt | head -5
echo "loop3 done $((SECONDS-T0)) s"
F='*WgradExact*/AdamW_Wbf16_Sint8:*WgradExact*/AdamW_Wbf16_Sbf16:*WgradExact*/AdamW_Wbf16sr_Sint8:*WgradOddShapes*/out129_in17_T4097:*WgradNonFinite*/Wbf16sr_Sint8'
FORGE_CUDA_TILE_LOOP=3 timeout 100 $S --tool memcheck --error-exitcode 99 build-sm90/tests/cpp/gpu/forge_gpu_tests --gtest_filter="$F" > $OUT/memcheck.txt 2>&1; echo "memcheck rc $? $(grep 'ERROR SUMMARY' $OUT/memcheck.txt | tail -1) $(grep -o '\[  PASSED  \] [0-9]* test' $OUT/memcheck.txt)"
FORGE_CUDA_TILE_LOOP=3 timeout 100 $S --tool racecheck --error-exitcode 99 build-sm90/tests/cpp/gpu/forge_gpu_tests --gtest_filter='*WgradExact*/AdamW_Wbf16_Sint8:*WgradExact*/AdamW_Wbf16_Sbf16:*WgradOddShapes*/out129_in17_T4097' > $OUT/racecheck.txt 2>&1; echo "racecheck rc $? $(grep 'RACECHECK SUMMARY' $OUT/racecheck.txt | tail -1) $(grep -o '\[  PASSED  \] [0-9]* test' $OUT/racecheck.txt)"
echo "sanitizers done $((SECONDS-T0)) s"
FORGE_CUDA_TILE_LOOP=1 OMP_NUM_THREADS=2 timeout 170 ctest --test-dir build-sm90 -L gpu -j 8 > $OUT/ctest-loop1-all.txt 2>&1; echo "loop1 all: $(grep 'tests passed' $OUT/ctest-loop1-all.txt)"; grep -i 'failed\b' $OUT/ctest-loop1-all.txt | head -5
echo "all done $((SECONDS-T0)) s"
tar czf $OUT/ab.tgz -C /tmp ab
