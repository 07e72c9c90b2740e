# usage: bash abpair.sh REPS label:builddir[:VAR=value] ... (device: A/B of carried builds, alternating)
reps=$1; shift
rm -rf /tmp/ab; mkdir -p /tmp/ab
for rep in $(seq 1 $reps); do
  list=("$@"); if ((rep % 2 == 0)); then list=(); for ((j=$#; j>=1; j--)); do list+=("${!j}"); done; fi
  for item in "${list[@]}"; do
    IFS=: read -r label dir envv <<<"$item"; d=/tmp/ab/$label-r$rep; mkdir -p $d
    env ${envv:-} LD_LIBRARY_PATH=$PWD/$dir $dir/bench/wgrad_bench ${BENCH_ARGS:-} --out $d > $d/console.txt 2>&1 || tail -3 $d/console.txt
  done
done
python3 bench/ab_totals.py /tmp/ab
