# Where MoonBright's time goes in batch-1 decoding (decode_speed.py's model): the statistics
# that change over one generate call, per token, under the MOONBRIGHT_ALLOC_CONF given.
import json, os, sys, time
import torch
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
        model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)
    torch.cuda.synchronize()
    return new / (time.perf_counter() - t)
run(); run()
st0 = moonbright.memory_stats()
rate = run()
st1 = moonbright.memory_stats()
delta = {k: round((st1[k] - st0.get(k, 0)) / new, 3) for k in st1
         if isinstance(st1[k], (int, float)) and st1[k] != st0.get(k, 0)}
print(json.dumps({"conf": os.environ.get("MOONBRIGHT_ALLOC_CONF", ""), "tok_s": rate,
                  "per_token": delta}))
