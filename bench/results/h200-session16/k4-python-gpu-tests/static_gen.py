
import json, sys, torch, moonbright
MB = sys.argv[1] == "moonbright"
if MB:
    import moonbright.torch
    moonbright.torch.enable()
from transformers import LlamaConfig, LlamaForCausalLM
from torch._inductor import cudagraph_trees
torch.manual_seed(0)
torch.backends.cuda.matmul.allow_tf32 = False
cfg = LlamaConfig(
    vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
)
model = LlamaForCausalLM(cfg).cuda().eval()
ids = torch.randint(0, 1000, (2, 24), generator=torch.Generator().manual_seed(1)).cuda()
model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
runs = []
with torch.no_grad():
    for _ in range(3):
        out = model.generate(
            ids, max_new_tokens=24, do_sample=False, pad_token_id=0,
            cache_implementation="static",
        )
        runs.append(out.tolist())
torch.cuda.synchronize()
mgr = cudagraph_trees.get_manager(torch.cuda.current_device(), create_if_none_exists=False)
print(json.dumps({
    "tokens": runs,
    "graphs": next(mgr.graph_counter) if mgr is not None else 0,
    "skips": int(torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]),
    "errors": moonbright.last_error() if MB else None,
}))
