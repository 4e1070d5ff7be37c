#!/usr/bin/env bash
# Session 17, l4: as l3, in the GPU test's environment (CUBLAS_WORKSPACE_CONFIG=:4096:8), and
# PyTorch's trace there.
# addr_gen.py: l3-'s for l4-; l6-'s for l5-, except that l5-'s named the trace path `out`, as the output it keeps.
r=$OUT/r; mkdir -p $r
SITE=$SITE; export SITE PYTHONPATH=$SITE HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export CUBLAS_WORKSPACE_CONFIG=:4096:8 MOONBRIGHT_ALLOC_CONF=
python3 -m pip install -q --upgrade --no-index --no-deps --target $SITE carry/wheel/moonbright-*.whl
for run in moonbright:1 moonbright:2 pytorch:1; do
  m=${run%:*}; n=${run#*:}
  TORCH_LOGS=cudagraphs timeout 150 python3 carry/addr_gen.py $m none nohist > $r/addr_${m}_$n.out 2> $r/addr_${m}_$n.err; echo "$run rc=$?"
  cat $r/addr_${m}_$n.out; grep -c "Re-recording" $r/addr_${m}_$n.err
  grep "pointer changed from" $r/addr_${m}_$n.err | sed 's/input stack trace.*//' | cut -c90- | head -8
done
timeout 150 python3 carry/addr_gen.py pytorch $r/trace_pytorch.json.gz > $r/addr_pytorch_hist.out 2> $r/addr_pytorch_hist.err; echo "pytorch hist rc=$?"; cat $r/addr_pytorch_hist.out
cp carry/addr_gen.py carry/addr4.sh $r/
cd $OUT && tar czf r.tgz r && rm -rf r
