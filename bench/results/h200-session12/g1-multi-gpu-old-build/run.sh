r=$OUT/r; mkdir -p $r
export PYTHONPATH=$SITE
python3 -m pip install -q --upgrade --no-index --no-deps --target $SITE carry/wheel/moonbright-*.whl
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv > $r/gpus.txt
nvidia-smi topo -m >> $r/gpus.txt 2>&1
python3 -c "import torch; print(torch.__version__, torch.cuda.device_count())" >> $r/gpus.txt
timeout 500 python3 -m pytest -q -s -rA python/tests/gpu/test_multi_gpu.py > $r/multi-gpu.log 2>&1; echo "rc=$?" >> $r/multi-gpu.log
tail -n 30 $r/multi-gpu.log
cd $OUT && tar czf r.tgz r && rm -rf r
