# Where transformers' static-cache tensors land in each of three generate calls, and the
# allocation trace (PyTorch's snapshot format) of the whole run, under one allocator.
import gzip, json, sys, torch, moonbright
MB = sys.argv[1] == "moonbright"
out = sys.argv[2]
HIST = len(sys.argv) < 4 or sys.argv[3] != "nohist"
if MB:
    import moonbright.torch
    moonbright.torch.enable()
    if HIST:
        moonbright.record_memory_history(True, max_entries=1_000_000)
elif HIST:
    torch.cuda.memory._record_memory_history(max_entries=1_000_000)
from transformers import LlamaConfig, LlamaForCausalLM, cache_utils
from torch._inductor import cudagraph_trees
log = []
orig = cache_utils.StaticLayer.lazy_initialization
def hooked(self, k, v):
    orig(self, k, v)
    log.append([self.keys.data_ptr(), self.values.data_ptr(), self.cumulative_length.data_ptr(),
                self.keys.nbytes, self.cumulative_length.nbytes])
cache_utils.StaticLayer.lazy_initialization = hooked
torch.manual_seed(0)
torch.backends.cuda.matmul.allow_tf32 = False
cfg = LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256)
model = LlamaForCausalLM(cfg).cuda().eval()
ids = torch.randint(0, 1000, (2, 24), generator=torch.Generator().manual_seed(1)).cuda()
marks = []
with torch.no_grad():
    for _ in range(3):
        model.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=0,
                       cache_implementation="static")
        torch.cuda.synchronize()
        marks.append(len(log))
mgr = cudagraph_trees.get_manager(torch.cuda.current_device(), create_if_none_exists=False)
tr = []
if HIST:
    snap = moonbright.snapshot() if MB else torch.cuda.memory._snapshot()
    keys = ("action", "addr", "size", "stream", "time_us")
    tr = [[{k: e.get(k) for k in keys} for e in dev] for dev in snap["device_traces"]]
    with gzip.open(out, "wt") as f:
        json.dump({"device_traces": tr}, f)
print(json.dumps({"cache": log, "marks": marks,
                  "graphs": next(mgr.graph_counter) if mgr is not None else 0,
                  "events": [len(d) for d in tr]}))
