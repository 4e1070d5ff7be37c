# Greedy decoding speed of a small random-weight Llama at batch 1 (launch-bound: many small
# allocations per token), under PyTorch's allocator ("pytorch"), MoonBright with its defaults
# ("moonbright"), or MoonBright under the MOONBRIGHT_ALLOC_CONF given. One JSON line.
import json, os, sys, time
import torch
import os as _os
if sys.argv[1] == "minimal":
    _a = torch.cuda.memory.CUDAPluggableAllocator(_os.path.join(_os.path.dirname(_os.path.abspath(__file__)), "minimal_alloc.so"), "min_alloc", "min_free")
    torch.cuda.memory.change_current_allocator(_a)
mode = sys.argv[1]
if mode == "moonbright":
    import moonbright, moonbright.torch
    moonbright.torch.enable()
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
cfg = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=12,
                  num_attention_heads=16, num_key_value_heads=4, vocab_size=32000,
                  max_position_embeddings=2048)
model = LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
ids = torch.randint(0, 32000, (1, 32), device="cuda")
new = 256
def run():
    torch.cuda.synchronize()
    t = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)
    torch.cuda.synchronize()
    return new / (time.perf_counter() - t), out
run()
rates, out = [], None
for _ in range(5):
    r, out = run()
    rates.append(r)
res = {"mode": mode, "conf": os.environ.get("MOONBRIGHT_ALLOC_CONF", ""),
       "tok_s": sorted(rates), "median_tok_s": sorted(rates)[2],
       "tokens_hash": hash(tuple(out[0].tolist()))}
if mode == "moonbright":
    st0 = moonbright.memory_stats()
    run()
    st1 = moonbright.memory_stats()
    res["allocs_per_token"] = (st1["allocation.all.allocated"] - st0["allocation.all.allocated"]) / new
    res["driver_calls_per_token"] = (st1["moonbright.driver_calls.total"] - st0["moonbright.driver_calls.total"]) / new
print(json.dumps(res))
