#!/usr/bin/env bash
# Session 17, l6: PyTorch's trace of the static-cache generate with each output kept live
# through the next call, as the GPU test keeps it (l5's trace failed on a name clash).
r=$OUT/r; mkdir -p $r
SITE=$SITE; export SITE PYTHONPATH=$SITE HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export CUBLAS_WORKSPACE_CONFIG=:4096:8 MOONBRIGHT_ALLOC_CONF=
python3 -m pip install -q --upgrade --no-index --no-deps --target $SITE carry/wheel/moonbright-*.whl
timeout 150 python3 carry/addr_gen.py pytorch $r/trace_pytorch.json.gz > $r/addr_pytorch_hist.out 2> $r/addr_pytorch_hist.err; echo "pytorch hist rc=$?"; cat $r/addr_pytorch_hist.out
cp carry/addr_gen.py carry/addr6.sh $r/
cd $OUT && tar czf r.tgz r && rm -rf r
