import json, torch, moonbright, moonbright.torch
moonbright.torch.enable()
main, side = torch.cuda.current_stream(), torch.cuda.Stream()
w = torch.ones(256, device="cuda")
with torch.cuda.stream(side):
    torch.cuda._sleep(1000); w = w * 2
w = torch.full((256,), 7.0, device="cuda"); torch.cuda.synchronize(); del w
out = {}
with torch.cuda.stream(side):
    g = torch.accelerator.current_stream() if hasattr(torch, "accelerator") else None
out["generic_type"] = type(g).__name__ if g is not None else None
x = torch.ones(250, device="cuda"); ptr = x.data_ptr()
side.wait_stream(main)
with torch.cuda.stream(side):
    torch.cuda._sleep(200_000_000); y = x * 2
x.record_stream(g if g is not None else side)
del x
z = torch.full((250,), 7.0, device="cuda")
out["reused_early"] = z.data_ptr() == ptr
out["side_busy"] = not side.query()
torch.cuda.synchronize()
out["side_read_ok"] = bool((y == 2).all())
out["joined"] = moonbright.memory_stats()["moonbright.joined_frees"]
sp = torch.sparse_coo_tensor(torch.tensor([[0, 1]]), torch.tensor([1.0, 2.0]), (4,), device="cuda")
try:
    sp.record_stream(side); out["sparse"] = "ok"
except Exception as e:
    out["sparse"] = repr(e)[:200]
print(json.dumps(out))
