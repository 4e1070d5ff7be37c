#!/usr/bin/env bash
# Session 19, m1: the fragmentation stress (MoonBright only) with the policy of branch
# experiment/fresh-instead-of-stitch against the default, interleaved, three rounds; and
# bench/large_mix.py's trace once each. "default" is the branch's build with the policy off
# (MB_STITCH unset), so both sides are the same binary.
r=$OUT/r; mkdir -p $r
source scripts/nvrtc-env.sh >/dev/null 2>&1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > $r/gpu.txt
python3 bench/large_mix.py $r/large_mix.csv.gz > $r/large_mix.txt
for round in 1 2 3; do
  for cfg in "0 0" "3 32" "2 16"; do
    set -- $cfg; tag=stitch$1_share$2
    MB_STITCH=$1 MB_SHARE=$2 timeout 80 carry/bin-fis/stress --no-baseline --json $r/stress_${tag}_$round.json > $r/stress_${tag}_$round.log 2>&1
    echo "stress $tag round $round rc=$? $(grep -E '^MoonBright  ' $r/stress_${tag}_$round.log)"
    grep -oE "fresh_instead_of_stitched [0-9]+|request_mapped_handles [0-9]+|trimmed_chunks [0-9]+" $r/stress_${tag}_$round.log | head -3 | tr '\n' ' '; echo
    if [ $round -eq 1 ]; then
      MB_STITCH=$1 MB_SHARE=$2 timeout 90 carry/bin-fis/moonbright replay --backend cuda $r/large_mix.csv.gz > $r/replay_large_mix_${tag}.log 2>&1
      echo "large_mix $tag rc=$? $(grep -E 'alloc latency|reserved' $r/replay_large_mix_${tag}.log | head -3 | tr '\n' ' ')"
    fi
  done
done
rm -f $r/large_mix.csv.gz
cp carry/m1.sh $r/run.sh
sed -i "s|$OUT|\$OUT|g" $r/*.log $r/*.txt $r/*.json 2>/dev/null
cd $OUT && tar czf r.tgz r && rm -rf r
