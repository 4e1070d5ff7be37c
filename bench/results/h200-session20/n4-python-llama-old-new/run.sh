#!/usr/bin/env bash
# Session 20, n4: is the Python suite's longer run in n3 (301 s against session 19's 240 s) this
# session's change or the machine? Its slowest test (Llama generate and train, both option sets)
# with the wheel before the session (eb38758) and this one, interleaved.
r=$OUT/r; mkdir -p $r
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
python3 -m pip install -q --upgrade --no-index --no-deps --target $SITE carry/wheel/moonbright-*.whl
python3 -m pip install -q --upgrade --no-index --no-deps --target $SITE_OLD carry/wheel-old/moonbright-*.whl
source scripts/nvrtc-env.sh >/dev/null 2>&1
for t in old_1 new_1 old_2 new_2; do
  site=$SITE; [ ${t%_*} = old ] && site=$SITE_OLD
  (cd python/tests/gpu && PYTHONPATH=$site timeout 110 python3 -m pytest -q -s --tb=short --durations=3 test_torch_gpu.py -k llama_generate > $r/llama_$t.log 2>&1; echo "rc=$?" >> $r/llama_$t.log)
  echo "$t: $(grep -E 'call|passed|failed|rc=' $r/llama_$t.log | tr '\n' ' ' | cut -c1-400)"
done
cp carry/n4.sh $r/run.sh
cd $OUT && tar czf r.tgz r && rm -rf r
