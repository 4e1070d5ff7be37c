# Does MoonBright's background worker (event queries, unmaps, window refills) or another
# thread's allocations break a PyTorch graph capture in global mode on another thread?
import json, sys, threading, time, torch
mode = sys.argv[1]          # "moonbright" or "pytorch"
what = sys.argv[2]          # "worker" or "thread"
if mode == "moonbright":
    import moonbright, moonbright.torch
    moonbright.torch.enable()
out = {"mode": mode, "what": what}
a = torch.ones(1 << 20, device="cuda"); b = torch.empty_like(a)
side = torch.cuda.Stream()
torch.cuda.synchronize()
# Pending frees: tensors made and freed on a side stream behind a 1 s sleep, so the worker keeps
# polling their events (and has work) during the capture.
with torch.cuda.stream(side):
    torch.cuda._sleep(2_000_000_000)
    tmp = [torch.ones((1 << 18) * (i + 1), device="cuda") for i in range(40)]
    del tmp
stop = threading.Event()
errors = []
def churn():
    # Another thread allocating new sizes on its own stream (slow paths: maps) during capture.
    s = torch.cuda.Stream()
    i = 0
    with torch.cuda.stream(s):
        while not stop.is_set():
            try:
                n = (1 << 20) if what == "hits" else (1 << 20) * (1 + i % 37)
                x = torch.empty(n, dtype=torch.uint8, device="cuda")
                del x
            except Exception as e:
                errors.append(repr(e)[:300]); break
            i += 1
    out["churn_allocs"] = i
t = None
if what in ("thread", "hits"):
    t = threading.Thread(target=churn); t.start(); time.sleep(0.05)
g = torch.cuda.CUDAGraph()
s = torch.cuda.Stream()
s.wait_stream(torch.cuda.current_stream())
t0 = time.time()
try:
    with torch.cuda.stream(s):
        with torch.cuda.graph(g, stream=s):
            for _ in range(3000):
                torch.mul(a, 2, out=b)
                b.add_(1)
    out["capture"] = "ok"
except Exception as e:
    out["capture"] = repr(e)[:400]
out["capture_s"] = round(time.time() - t0, 3)
stop.set()
if t: t.join()
out["thread_errors"] = errors
try:
    if out["capture"] == "ok":
        g.replay(); torch.cuda.synchronize()
        out["replay_ok"] = bool((b == 3).all())
except Exception as e:
    out["replay"] = repr(e)[:300]
torch.cuda.synchronize()
if mode == "moonbright":
    out["deferred_errors"] = moonbright.memory_stats()["moonbright.deferred_errors"]
    out["last_error"] = moonbright.last_error()
print(json.dumps(out))
