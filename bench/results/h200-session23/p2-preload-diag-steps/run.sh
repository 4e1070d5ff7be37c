#!/usr/bin/env bash
# Session 23, p2: why PyTorch failed under the interposer (p1): step by step, with and
# without PyTorch's cache, with CUDA_LAUNCH_BLOCKING, and under compute-sanitizer.
r=$OUT/r; mkdir -p $r
L=$PWD/carry/lib/libmoonbright_preload.so
for v in "plain" "nocache PYTORCH_NO_CUDA_MEMORY_CACHING=1" "noworker MOONBRIGHT_ALLOC_CONF=background:false" "nocache-noworker PYTORCH_NO_CUDA_MEMORY_CACHING=1 MOONBRIGHT_ALLOC_CONF=background:false" "blocking CUDA_LAUNCH_BLOCKING=1"; do
  set -- $v; n=$1; shift
  echo "== $n"; env "$@" LD_PRELOAD=$L timeout 60 python3 carry/diag.py > $r/diag-$n.log 2>&1; echo "rc=$?" >> $r/diag-$n.log
  cut -c1-300 $r/diag-$n.log | tail -14
done
CS=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1); echo "cs=$CS"
if [ -n "$CS" ]; then
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 150 $CS --tool memcheck --print-limit 5 env LD_PRELOAD=$L python3 carry/diag.py > $r/cs.log 2>&1; echo "rc=$?" >> $r/cs.log
  grep -vE "^\s*$" $r/cs.log | cut -c1-250 | head -60
fi
cp carry/g2.sh $r/run.sh
cd $OUT && tar czf r.tgz r && rm -rf r
