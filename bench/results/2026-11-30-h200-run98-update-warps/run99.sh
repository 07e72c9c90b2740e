# Run 99 (device): the committed default (build-sm90 at d83b444's source), 9 full wgrad_bench
# runs at T = 512 in a row, for the spread of the T = 512 speedup.
set -u
rm -rf /tmp/m; mkdir -p /tmp/m
for r in 1 2 3 4 5 6 7 8 9; do
  mkdir -p /tmp/m/auto-r$r; LD_LIBRARY_PATH=$PWD/build-sm90 build-sm90/bench/wgrad_bench --tokens 512 --out /tmp/m/auto-r$r > /tmp/m/console-$r.txt 2>&1 || tail -3 /tmp/m/console-$r.txt
  grep -A3 "^| T | fused bf16" /tmp/m/auto-r$r/bench.md | tail -1
done
python3 bench/ab_totals.py /tmp/m > $OUT/run99-totals.md; cat $OUT/run99-totals.md | head -12
tar czf $OUT/run99-raw.tgz -C /tmp m
