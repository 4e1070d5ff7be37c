#!/usr/bin/env bash
# Session 24, i2: the cost of sharing again (export descriptors kept), the round trip against
# cudaIpc, then everything else on chunks created with POSIX file descriptor handles (the new
# default): the CUDA test binaries and the Python GPU tests (all but the compile tests).
r=$OUT/r; mkdir -p $r
SITE=${SITE:-$SITE}; export SITE PYTHONPATH=$SITE HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
source scripts/nvrtc-env.sh >/dev/null
python3 -m pip install -q --upgrade --no-index --no-deps --target $SITE carry/wheel/moonbright-*.whl 2>&1 | grep -v WARNING
export MOONBRIGHT_ALLOC_CONF=""
SECONDS=0
timeout 120 carry/bin/ipccost --json $r/ipccost.json > $r/ipccost.log 2>&1; echo "ipccost rc=$? (${SECONDS}s)" >> $r/ipccost.log
cat $r/ipccost.log
timeout 150 python3 bench/ipc_pairs.py --json $r/ipc_pairs.json > $r/ipc_pairs.log 2>&1; echo "pairs rc=$?" >> $r/ipc_pairs.log
tail -c 2500 $r/ipc_pairs.log; echo "(${SECONDS}s)"
for b in unit conformance faults streams capture growable paged ipc; do
  timeout 100 carry/bin/$b --test-threads=1 > $r/bin_$b.log 2>&1; echo "$b rc=$? $(grep -E '^test result' $r/bin_$b.log | tail -1)"
done
echo "(${SECONDS}s)"
export MOONBRIGHT_PRELOAD_LIB=$PWD/carry/lib/libmoonbright_preload.so
left=$((560 - SECONDS))
(cd python/tests/gpu && timeout $left python3 -m pytest -q --tb=short --durations=5 --ignore=test_compile_gpu.py . > $r/pygpu.log 2>&1; echo "pygpu rc=$?" >> $r/pygpu.log)
grep -E "passed|failed|rc=|^E |^FAILED" $r/pygpu.log | cut -c1-400 | head -20; echo "(${SECONDS}s)"
cp carry/g2.sh $r/run.sh
cd $OUT && tar czf r.tgz r && rm -rf r
