# Why is a launch-bound eager forward slower under MoonBright? Alloc/free pairs through PyTorch
# on the legacy default stream and on a side stream, the driver calls MoonBright's hot path makes
# timed alone (ctypes), and the 24-layer forward on each stream. One JSON line.
import ctypes, json, sys, time
import torch
import os as _os
if sys.argv[1] == "minimal":
    _a = torch.cuda.memory.CUDAPluggableAllocator(_os.path.join(_os.path.dirname(_os.path.abspath(__file__)), "minimal_alloc.so"), "min_alloc", "min_free")
    torch.cuda.memory.change_current_allocator(_a)
MB = sys.argv[1] == "moonbright"
if MB:
    import moonbright, moonbright.torch
    moonbright.torch.enable()
out = {"allocator": sys.argv[1]}
torch.cuda.init()
side = torch.cuda.Stream()

def per_call_us(fn, n=20000):
    for _ in range(200):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    dt = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return round(dt, 3)

def pair(nbytes):
    def f():
        t = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        del t
    return f

for name, ctx in (("default", torch.cuda.stream(torch.cuda.default_stream())), ("side", torch.cuda.stream(side))):
    with ctx:
        for nb in (4096, 1 << 20, 16 << 20):
            out[f"pair_{name}_{nb}"] = per_call_us(pair(nb))
        out[f"empty_cpu_ref"] = None
# Driver calls alone.
cuda = ctypes.CDLL("libcuda.so.1")
cap = ctypes.c_int()
ev = ctypes.c_void_p()
cuda.cuEventCreate(ctypes.byref(ev), 2)  # CU_EVENT_DISABLE_TIMING
for name, s in (("default", 0), ("per_thread", 2), ("side", side.cuda_stream)):
    h = ctypes.c_void_p(s)
    out[f"isCapturing_{name}"] = per_call_us(lambda: cuda.cuStreamIsCapturing(h, ctypes.byref(cap)))
    out[f"eventRecord_{name}"] = per_call_us(lambda: cuda.cuEventRecord(ev, h))
    info = (ctypes.c_int(), ctypes.c_ulonglong())
    out[f"getCaptureInfo_{name}"] = per_call_us(lambda: cuda.cuStreamGetCaptureInfo_v2(h, ctypes.byref(info[0]), ctypes.byref(info[1]), None, None, None))
ctx_ = ctypes.c_void_p()
out["ctxGetCurrent"] = per_call_us(lambda: cuda.cuCtxGetCurrent(ctypes.byref(ctx_)))
# The model.
torch.manual_seed(0)
layers = []
for _ in range(24):
    layers += [torch.nn.Linear(512, 512), torch.nn.GELU()]
model = torch.nn.Sequential(*layers).cuda().eval()
x = torch.randn(8, 512, device="cuda")
def fwd():
    with torch.no_grad():
        model(x)
for name, s in (("default", torch.cuda.default_stream()), ("side", side)):
    with torch.cuda.stream(s):
        x = x.to("cuda")
        out[f"forward_{name}_us"] = per_call_us(fwd, 2000)
if MB:
    st0 = moonbright.memory_stats()
    fwd(); torch.cuda.synchronize()
    st1 = moonbright.memory_stats()
    out["allocs_per_forward"] = st1["allocation.all.allocated"] - st0["allocation.all.allocated"]
    out["driver_calls_per_forward"] = {k[len("moonbright.driver_calls."):]: st1[k] - st0.get(k, 0) for k in st1 if k.startswith("moonbright.driver_calls.") and st1[k] != st0.get(k, 0)}
print(json.dumps(out))
