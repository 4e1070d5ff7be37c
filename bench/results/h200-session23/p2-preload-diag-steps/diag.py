import ctypes, json, os, sys, torch
lib = ctypes.CDLL(None)
def rep():
    try:
        f = lib.moonbright_preload_report
    except AttributeError:
        return None
    f.restype = ctypes.c_size_t; f.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    n = f(None, 0); b = ctypes.create_string_buffer(n + 1); f(b, n + 1)
    e = lib.moonbright_preload_last_error; e.restype = ctypes.c_size_t; e.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    m = ctypes.create_string_buffer(4096); e(m, 4096)
    return json.loads(b.value), m.value.decode()
def step(name, f):
    try:
        r = f(); torch.cuda.synchronize()
        print(f"ok   {name}: {r}", flush=True)
    except Exception as ex:
        print(f"FAIL {name}: {type(ex).__name__}: {str(ex).splitlines()[0]}", flush=True)
        print("     report:", rep(), flush=True)
        sys.exit(1)
st = {}
def keep(name, t):
    st[name] = t
    return hex(t.data_ptr())
step("empty 256 floats", lambda: keep("x", torch.empty(256, device="cuda")))
step("fill", lambda: st["x"].fill_(1.0) is not None)
step("sum", lambda: st["x"].sum().item())
step("h2d 256 floats", lambda: keep("y", torch.ones(256).cuda()))
step("h2d 4 MiB", lambda: keep("z", torch.ones(1 << 20).cuda()))
step("h2d 64 MiB", lambda: keep("w", torch.ones(16 << 20).cuda()))
step("sums", lambda: [st[k].sum().item() for k in "yzw"])
step("d2h", lambda: st["x"].cpu().sum().item())
step("matmul", lambda: (torch.randn(512, 512, device="cuda") @ torch.randn(512, 512, device="cuda")).norm().item())
print("report", rep())
