# torch.compile under MoonBright's global mode, in the mode given (default reduce-overhead: CUDA
# graphs via cudagraph trees): does it run, fall back, or fail? Prints one JSON line.
import json, sys, traceback, warnings
import torch
mode = sys.argv[1]
cmode = sys.argv[2] if len(sys.argv) > 2 else "reduce-overhead"
if mode == "moonbright":
    import moonbright, moonbright.torch
    moonbright.torch.enable()
def f(x, w):
    return torch.relu(x @ w).sum(dim=0) * 2 + 1
x = torch.randn(256, 256, device="cuda"); w = torch.randn(256, 256, device="cuda")
ref = f(x, w)
out = {"mode": mode, "compile_mode": cmode}
try:
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter("always")
        cf = torch.compile(f, mode=cmode)
        ys = [cf(x, w).clone() for _ in range(4)]
        torch.cuda.synchronize()
    out["ok"] = all(torch.allclose(y, ref, rtol=1e-3, atol=1e-3) for y in ys)
    out["warnings"] = [str(w.message)[:300] for w in ws][:5]
except Exception as e:
    out["error"] = f"{type(e).__name__}: {str(e)[:600]}"
try:
    import torch._dynamo.utils as du
    out["cudagraph_counters"] = {k: dict(v) for k, v in du.counters.items() if "graph" in k or "inductor" in k}
except Exception as e:
    out["counters_error"] = str(e)
print(json.dumps(out, default=str))
