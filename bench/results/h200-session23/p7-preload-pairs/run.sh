#!/usr/bin/env bash
# Session 23, p7: unmodified PyTorch's alloc+free pairs under the interposer against the CUDA
# runtime's own calls (bench/preload_pairs.py), without PyTorch's cache and with its
# cudaMallocAsync backend, three rounds, interleaved.
r=$OUT/r; mkdir -p $r
L=$PWD/carry/lib/libmoonbright_preload.so
SECONDS=0
for i in 1 2 3; do
  for mode in nocache async; do
    for who in runtime preload; do
      e="PYTORCH_NO_CUDA_MEMORY_CACHING=1"; [ $mode = async ] && e="PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync"
      p=""; [ $who = preload ] && p="LD_PRELOAD=$L"
      env MOONBRIGHT_ALLOC_CONF= $e $p timeout 60 python3 bench/preload_pairs.py > $r/${mode}_${who}_$i.json 2> $r/${mode}_${who}_$i.err
      echo "$mode $who $i rc=$? (${SECONDS}s) $(cut -c1-330 $r/${mode}_${who}_$i.json)"
    done
  done
done
cp carry/g7.sh $r/run.sh
cd $OUT && tar czf r.tgz r && rm -rf r
