# torch.distributed (NCCL) data-parallel training under MoonBright on 2 GPUs: the same losses
# as under PyTorch's allocator, async all-reduces, and MoonBright's statistics per rank.
import json, os, sys, torch, torch.distributed as dist
mode = sys.argv[1]
rank = int(os.environ["LOCAL_RANK"])
if mode == "moonbright":
    # Before anything initialises CUDA in PyTorch, set_device included.
    import moonbright, moonbright.torch
    moonbright.torch.enable()
torch.cuda.set_device(rank)
dist.init_process_group("nccl")
torch.manual_seed(0)
model = torch.nn.Sequential(
    torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024)
).cuda()
ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[rank], bucket_cap_mb=4)
opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
g = torch.Generator(device="cuda").manual_seed(100 + rank)
losses = []
for step in range(20):
    x = torch.randn(64, 1024, device="cuda", generator=g)
    loss = (ddp(x) ** 2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
    t = loss.detach().clone()
    dist.all_reduce(t)
    losses.append(round(t.item() / 2, 6))
# Async all-reduces of fresh tensors, each waited on, and a checksum.
works, outs = [], []
for i in range(50):
    y = torch.full((1 << 18,), float(rank + i), device="cuda")
    works.append(dist.all_reduce(y, async_op=True)); outs.append(y)
for w in works: w.wait()
ok = all(bool((y == 2 * i + 1).all()) for i, y in enumerate(outs))
torch.cuda.synchronize()
out = {"mode": mode, "rank": rank, "losses_first_last": [losses[0], losses[-1]], "losses": losses, "async_ok": ok}
if mode == "moonbright":
    st = moonbright.memory_stats()
    out["mb"] = {k: st[k] for k in ("moonbright.deferred_errors", "moonbright.joined_frees", "allocated_bytes.all.peak", "reserved_bytes.all.peak")}
dist.destroy_process_group()
print(json.dumps(out))
