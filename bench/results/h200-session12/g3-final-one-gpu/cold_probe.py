# Which calls a slow cold map made: 200 allocations of one size on GPU 0, kept, then freed and
# empty_cache(); three rounds. For allocations over 300 us, the stat counters that changed.
import ctypes, json, os, sys, time
os.environ["MOONBRIGHT_ALLOC_CONF"] = "prefetch_window_max:0"
import moonbright
lib = ctypes.CDLL(moonbright.library_path())
lib.moonbright_alloc.restype = ctypes.c_void_p
lib.moonbright_alloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
lib.moonbright_free.restype = None
lib.moonbright_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
size = int(sys.argv[1]) << 20
def snap():
    s = moonbright.memory_stats(0)
    return {k: v for k, v in s.items() if k.startswith("moonbright.") and isinstance(v, int)}
for rnd in range(3):
    ptrs, slow, times = [], [], []
    for i in range(200):
        a = snap(); t = time.perf_counter_ns()
        p = lib.moonbright_alloc(size, 0, None)
        dt = (time.perf_counter_ns() - t) / 1000
        b = snap(); times.append(dt); ptrs.append(p)
        if dt > 300:
            slow.append((i, round(dt), {k: b[k] - a[k] for k in b if b[k] != a.get(k) and not k.endswith((".peak",".allocated",".freed"))}))
    for p in ptrs:
        lib.moonbright_free(p, size, 0, None)
    t = time.perf_counter_ns(); moonbright.empty_cache(0); ec = (time.perf_counter_ns() - t) / 1000
    times.sort()
    print(json.dumps({"round": rnd, "p50": times[100], "p90": times[180], "n_slow": len(slow), "empty_cache_us": ec, "slow": slow[:4]}))
