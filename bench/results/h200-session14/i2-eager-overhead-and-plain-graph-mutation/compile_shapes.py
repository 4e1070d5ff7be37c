# torch.compile reduce-overhead with new shapes and a mutated input: which check fails, under
# MoonBright (plain graphs) or PyTorch's allocator with trees ("trees") or plain graphs ("plain").
import json, sys, torch
mode = sys.argv[1]
if mode == "moonbright":
    import moonbright.torch
    moonbright.torch.enable()
elif mode == "plain":
    import torch._inductor.config as ic
    ic.triton.cudagraph_trees = False
torch.backends.cuda.matmul.allow_tf32 = False
torch.manual_seed(0)
def g(x):
    return torch.nn.functional.silu(x @ x.T).sum(dim=1)
def acc(buf, x):
    buf.add_(x.sum(dim=0))
    return buf * 2
fg = torch.compile(g, mode="reduce-overhead")
fa = torch.compile(acc, mode="reduce-overhead")
res = {"mode": mode, "g": [], "acc": []}
for n in (16, 32, 16, 32, 48):
    x = torch.randn(n, 256, device="cuda")
    y = fg(x).clone(); e = g(x)
    res["g"].append([n, list(y.shape), (y - e).abs().max().item(), e.abs().max().item()])
buf, ref = torch.zeros(256, device="cuda"), torch.zeros(256, device="cuda")
for _ in range(4):
    x = torch.randn(8, 256, device="cuda")
    out = fa(buf, x).clone(); expect = acc(ref, x)
    res["acc"].append([(buf - ref).abs().max().item(), (out - expect).abs().max().item()])
import torch._dynamo.utils as du
res["skips"] = du.counters["inductor"].get("cudagraph_skips", 0)
print(json.dumps(res))
