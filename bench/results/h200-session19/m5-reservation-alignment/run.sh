#!/usr/bin/env bash
# Session 19, m5: reservations of 1 GiB or more aligned to 1 GiB (driver::reservation_alignment).
# Where does the driver put a large reservation asked with 2 MiB alignment? Then the CUDA
# conformance suite (new test: the first range starts on a region), and the latency benchmark
# (no kernel part, no chunk table) with the build before and after, interleaved, twice each.
r=$OUT/r; mkdir -p $r
source scripts/nvrtc-env.sh >/dev/null 2>&1
python3 - > $r/reserve_probe.txt 2>&1 <<'PY'
import ctypes
cu = ctypes.CDLL("libcuda.so.1")
assert cu.cuInit(0) == 0
dev = ctypes.c_int(); assert cu.cuDeviceGet(ctypes.byref(dev), 0) == 0
ctx = ctypes.c_void_p(); assert cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0
assert cu.cuCtxSetCurrent(ctx) == 0
G = 1 << 30
for size_gib, align in [(280, 2 << 20), (280, 0), (280, G), (2, 2 << 20), (1, 2 << 20)]:
    for i in range(3):
        va = ctypes.c_uint64()
        rc = cu.cuMemAddressReserve(ctypes.byref(va), ctypes.c_size_t(size_gib * G), ctypes.c_size_t(align), ctypes.c_uint64(0), ctypes.c_uint64(0))
        print(f"reserve {size_gib} GiB align {align:#x}: rc {rc} va {va.value:#x} offset in its 1 GiB region {(va.value % G) >> 20} MiB")
        cu.cuMemAddressFree(va, ctypes.c_size_t(size_gib * G))
PY
cat $r/reserve_probe.txt
timeout 200 carry/bin/conformance cuda --test-threads 1 > $r/test-conformance.log 2>&1; echo "conformance rc=$?"; grep -E "reservations|test result" $r/test-conformance.log
for t in old_1 new_1 old_2 new_2; do
  bin=carry/bin; [ ${t%_*} = old ] && bin=carry/bin-old
  timeout 140 $bin/latency --no-kernel --no-chunks --json $r/latency_$t.json > $r/latency_$t.log 2>&1
  echo "latency $t rc=$? met $(grep -c '\[met\]' $r/latency_$t.log)"
  grep -E "alloc p50 .*set_access" $r/latency_$t.log | grep -E "1 GiB|8 GiB" | grep -E "cold map|empty region"
  grep -E "MISSED" $r/latency_$t.log
done
cp carry/m5.sh $r/run.sh
sed -i "s|$OUT|\$OUT|g" $r/*.log $r/*.json $r/*.txt 2>/dev/null
cd $OUT && tar czf r.tgz r && rm -rf r
