#!/usr/bin/env bash
# Session 14, i2: eager overhead under the pluggable allocator (default vs side stream, the hot
# path's driver calls alone), compile with new shapes / mutated inputs in three set-ups, and the
# reworked compile tests.
r=$OUT/r; mkdir -p $r
export SITE=$SITE PYTHONPATH=$SITE
python3 -m pip install -q --upgrade --no-index --no-deps --target $SITE carry/wheel/moonbright-*.whl
for m in moonbright pytorch; do timeout 120 python3 carry/exp/eager_overhead.py $m > $r/eager_$m.json 2> $r/eager_$m.err; done
for m in moonbright pytorch plain; do timeout 90 python3 carry/exp/compile_shapes.py $m > $r/shapes_$m.json 2> $r/shapes_$m.err; done
cd python/tests/gpu
timeout 240 python3 -m pytest -q -s --tb=short test_compile_gpu.py -k "inference or training" > $r/python-compile.log 2>&1; echo "python rc=$?" >> $r/tests.txt
cd - >/dev/null
cat $r/tests.txt; tail -n 3 $r/python-compile.log
cat $r/eager_*.json $r/shapes_*.json; tail -n 2 $r/eager_*.err $r/shapes_*.err
cd $OUT && tar czf r.tgz r && rm -rf r
