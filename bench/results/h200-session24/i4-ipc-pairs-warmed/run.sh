#!/usr/bin/env bash
# Session 24, i4: the cross-process round trip against cudaIpc again, with a ready handshake and
# untimed warm-up repetitions (i3 timed the child's start-up in its first repetition).
r=$OUT/r; mkdir -p $r
SITE=${SITE:-$SITE}; export SITE PYTHONPATH=$SITE HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
source scripts/nvrtc-env.sh >/dev/null
python3 -m pip install -q --upgrade --no-index --no-deps --target $SITE carry/wheel/moonbright-*.whl 2>&1 | grep -v WARNING
export MOONBRIGHT_ALLOC_CONF=""
SECONDS=0
timeout 200 python3 bench/ipc_pairs.py --json $r/ipc_pairs.json > $r/ipc_pairs.log 2>&1; echo "pairs rc=$?" >> $r/ipc_pairs.log
tail -c 3000 $r/ipc_pairs.log; echo "(${SECONDS}s)"


cp carry/g4.sh $r/run.sh
cd $OUT && tar czf r.tgz r && rm -rf r
