import json, torch, moonbright, moonbright.torch
out = {}
pool = moonbright.torch.pool()
x = torch.ones(1 << 20, device="cuda")
g = torch.cuda.CUDAGraph()
before = moonbright.memory_stats()["allocation.all.allocated"] if "allocation.all.allocated" in moonbright.memory_stats() else None
try:
    with torch.cuda.graph(g, pool=pool.id):
        y = x * 2
        z = y + 1
    g.replay(); torch.cuda.synchronize()
    out["capture"] = "ok"; out["ok"] = bool((z == 3).all())
except Exception as e:
    out["capture"] = repr(e)[:500]
    out["last_error"] = moonbright.last_error()
out["mb_allocations"] = moonbright.memory_stats().get("moonbright.requests", None)
out["mb_stats"] = {k: v for k, v in moonbright.memory_stats().items() if k.startswith("allocation.all") or k.startswith("segment.all")}
print(json.dumps(out))
