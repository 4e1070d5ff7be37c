"""What granting a peer GPU access costs a cold map: MoonBright's allocation of fresh memory
(create, map, set access of one handle) on GPU 0, first with no peer, then after
`enable_peer_access(1)`, when each set access names GPU 1 too. Needs two GPUs that reach each
other peer to peer. Prints one JSON line; `python3 bench/peer_cost.py > out.json`."""

import ctypes
import json
import os
import statistics
import time

os.environ["MOONBRIGHT_ALLOC_CONF"] = "prefetch_window_max:0"  # every request maps
import moonbright  # noqa: E402

lib = ctypes.CDLL(moonbright.library_path())
lib.moonbright_alloc.restype = ctypes.c_void_p
lib.moonbright_alloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
lib.moonbright_free.restype = None
lib.moonbright_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
MIB = 1 << 20


def cold_maps(size, n):
    """Median and p90 microseconds of `n` allocations of fresh memory on GPU 0."""
    times, ptrs = [], []
    for _ in range(n):
        t = time.perf_counter_ns()
        p = lib.moonbright_alloc(size, 0, None)
        times.append((time.perf_counter_ns() - t) / 1000)
        assert p, moonbright.last_error()
        ptrs.append(p)
    for p in ptrs:
        lib.moonbright_free(p, size, 0, None)
    moonbright.empty_cache(0)
    times.sort()
    return statistics.median(times), times[int(0.9 * len(times))]


cases = [(2 * MIB, 200), (64 * MIB, 100), (1024 * MIB, 20)]
out = {"rounds": 3, "sizes": {}}
for size, n in cases:
    cold_maps(size, 5)  # warm the paths
rows = {size: {"no_peer": [], "one_peer": []} for size, _ in cases}
for _ in range(3):
    for size, n in cases:
        rows[size]["no_peer"].append(cold_maps(size, n))
moonbright.enable_peer_access(1, device=0)
for _ in range(3):
    for size, n in cases:
        rows[size]["one_peer"].append(cold_maps(size, n))
for size, r in rows.items():
    a = statistics.median(m for m, _ in r["no_peer"])
    b = statistics.median(m for m, _ in r["one_peer"])
    out["sizes"][f"{size // MIB} MiB"] = {
        "no_peer_us": r["no_peer"], "one_peer_us": r["one_peer"],
        "median_no_peer": a, "median_one_peer": b, "ratio": b / a,
    }
out["peers"] = moonbright.peers(0)
out["set_access_calls"] = moonbright.memory_stats(0)["moonbright.driver_calls.set_access"]
print(json.dumps(out))
