#!/usr/bin/env bash
# Session 17, l5: as l4, with each generate's output kept live through the next call, as the
# GPU test keeps it; PyTorch's trace of that.
# addr_gen.py: l3-'s for l4-; l6-'s for l5-, except that l5-'s named the trace path `out`, as the output it keeps.
r=$OUT/r; mkdir -p $r
SITE=$SITE; export SITE PYTHONPATH=$SITE HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export CUBLAS_WORKSPACE_CONFIG=:4096:8 MOONBRIGHT_ALLOC_CONF=
python3 -m pip install -q --upgrade --no-index --no-deps --target $SITE carry/wheel/moonbright-*.whl
TORCH_LOGS=cudagraphs timeout 150 python3 carry/addr_gen.py moonbright none nohist > $r/addr_moonbright.out 2> $r/addr_moonbright.err; echo "moonbright rc=$?"
cat $r/addr_moonbright.out; grep -c "Re-recording" $r/addr_moonbright.err
timeout 150 python3 carry/addr_gen.py pytorch $r/trace_pytorch.json.gz > $r/addr_pytorch_hist.out 2> $r/addr_pytorch_hist.err; echo "pytorch hist rc=$?"; cat $r/addr_pytorch_hist.out
cp carry/addr_gen.py carry/addr5.sh $r/
cd $OUT && tar czf r.tgz r && rm -rf r
